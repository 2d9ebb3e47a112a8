"""`kvllm bench attention` hands its arguments to the kernel benchmark's main(argv)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvllm.entrypoints.cli import bench
from kvllm.entrypoints.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
needs_kernel_bench = pytest.mark.skipif(
    importlib.util.find_spec(bench.ATTENTION_KERNELS_MODULE) is None,
    reason="the attention kernel benchmark is not in this build yet",
)


def test_attention_arguments_go_to_the_kernel_benchmark_unchanged(monkeypatch):
    seen: list[list[str]] = []
    fake = types.ModuleType(bench.ATTENTION_KERNELS_MODULE)
    fake.__spec__ = importlib.machinery.ModuleSpec(bench.ATTENTION_KERNELS_MODULE, None)
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, bench.ATTENTION_KERNELS_MODULE, fake)
    assert main(["bench", "attention", "--backends", "TRITON_ATTN", "--batch-size", "4", "-h"]) == 0
    assert seen == [["--backends", "TRITON_ATTN", "--batch-size", "4", "-h"]]


@needs_kernel_bench
def test_attention_tiny_run_checks_before_timing(tmp_path):
    # A subprocess: the CPU run needs the Triton interpreter, chosen when triton is first imported.
    out = tmp_path / "attention.json"
    cmd = [
        sys.executable,
        "-m",
        "kvllm.entrypoints.cli.main",
        "bench",
        "attention",
        "--tiny",
        "--output-json",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    rows = report["rows"]
    shapes = {r["shape"] for r in rows}
    triton = [r for r in rows if r["kernel"] == "TRITON_ATTN"]
    assert triton and all(r["status"] == "ok" and r["rel_error"] < 1e-3 and r["ms"] > 0 for r in triton)
    # Every backend valid on the CPU gets a row per shape through its own builder and impl.forward,
    # checked against the float32 reference (float32 here: tolerance 1e-4) before it is timed.
    for name in ("CPU_ATTN", "FLEX_ATTENTION"):
        mine = [r for r in rows if r["kernel"] == name]
        assert {r["shape"] for r in mine} == shapes, name
        for r in mine:
            assert r["status"] == "ok", r
            assert r["rel_error"] < 1e-4 and r["ms"] > 0 and r["build_ms"] > 0, r
            assert "KV write" in r["note"] and r["extra"]["first_layer_ms"] > 0, r
            assert r["extra"]["build_ms_without_sync"] > 0 and r["extra"]["sync_alone_ms"] >= 0, r
    # Backends not valid here are reported with their reasons, not left out.
    for name in set(report["backends"]) - {"CPU_ATTN", "FLEX_ATTENTION", "TRITON_ATTN"}:
        mine = [r for r in rows if r["kernel"] == name]
        assert mine and all(r["status"] == "skipped" and "not valid on cpu" in r["note"] for r in mine), name


@needs_kernel_bench
def test_attention_backends_filter(tmp_path):
    out = tmp_path / "attention.json"
    cmd = [sys.executable, "-m", "kvllm.benchmarks.attention", "--tiny", "--only-shapes",
           "--shape", "one:2x1@20", "--backends", "CPU_ATTN", "--peers", "triton,sdpa",
           "--output-json", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    kernels = [r["kernel"] for r in report["rows"]]
    # TRITON_ATTN not named: its own rows go too; the peer kernels stay.
    assert kernels == ["CPU_ATTN", "SDPA (cpu default)"]
    assert report["timing"] == "host clock"  # --timing applies on a GPU only; the report says which ran


def test_kv_cache_views_follow_each_backends_layout():
    import torch

    from kvllm.attention.registry import get_backend_class, registered_backend_names
    from kvllm.attention.testing import kv_cache_views

    nb, bs, h, d = 3, 4, 2, 8
    for name in registered_backend_names():
        backend = get_backend_class(name)
        if backend.is_mla:  # one latent plane, no K/V views (kvllm.attention.mla_testing fills it)
            assert backend.get_kv_cache_shape(nb, bs, 1, d) == (nb, bs, d), name
            continue
        cache = torch.zeros(backend.get_kv_cache_shape(nb, bs, h, d))
        key, value = kv_cache_views(backend, cache)
        assert key.shape == value.shape == (nb, bs, h, d), name
        key[1, 2, 1] = 1.0
        value[2, 3, 0] = 2.0
        assert cache.sum() == 3.0 * d, name
        if name == "FLASHINFER":
            assert cache[1, 0, 2, 1].eq(1.0).all() and cache[2, 1, 3, 0].eq(2.0).all()
        else:
            assert cache[0, 1, 2, 1].eq(1.0).all() and cache[1, 2, 3, 0].eq(2.0).all(), name


@needs_kernel_bench
def test_attention_help_reaches_the_real_kernel_benchmark(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "attention", "--help"])
    assert exc.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_bench_without_a_benchmark_prints_help(capsys):
    assert main(["bench"]) == 2
    out = capsys.readouterr().out
    for name in ("latency", "throughput", "serve", "attention"):
        assert name in out
