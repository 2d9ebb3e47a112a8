"""TRITON_ATTN's prefill kernel against the float32 reference, on the CPU interpreter.

Tolerances as in test_triton_attention.py: float32 1e-5 relative (summation order only), float16
2e-3 relative / 1e-2 absolute (P and the output rounded to fp16). Small tiles (16-32 rows, 16
keys) give many q-blocks and KV tiles per request on tiny shapes, so the request search, the
latest-first q-block order, tiles crossing pages ("gather") or inside one page ("page", "tma") and
the masked/unmasked tile split are all exercised.
"""

from __future__ import annotations

import pytest
import torch

import kvllm.attention.ops.triton_prefill_attention as prefill_ops
import kvllm.attention.ops.triton_prefill_config as prefill_cfgs
import kvllm.attention.ops.triton_unified_attention as unified_ops
from kvllm.attention.ops.triton_prefill_attention import prefill_attention
from kvllm.attention.ops.triton_prefill_config import PrefillConfig, resolve_kv_load
from kvllm.attention.reference import make_paged_batch, reference_attention
from kvllm.attention.testing import run_triton_case

TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 1e-2)}
# Decodes first (the unified kernel's launch), then chunks with and without a cached prefix,
# one shorter than a q-block, one spanning several.
QUERY_LENS = [1, 9, 37, 70]
CONTEXT_LENS = [45, 21, 0, 50]
CONFIGS = {
    "gather": PrefillConfig(16, 16, 4, 1),
    "gather-pack": PrefillConfig(32, 16, 4, 2, pack_gqa=True),
    "page": PrefillConfig(32, 16, 4, 1, kv_load="page"),
    "tma": PrefillConfig(16, 16, 4, 1, kv_load="tma"),
    "tma-pack-ws": PrefillConfig(32, 16, 4, 2, pack_gqa=True, kv_load="tma", warp_specialize=True),
    "newkv": PrefillConfig(16, 16, 4, 1, new_kv=True),
    "newkv-tma-pack": PrefillConfig(32, 32, 4, 2, pack_gqa=True, kv_load="tma", new_kv=True),
}


def check(case, dtype: torch.dtype) -> None:
    rel_tol, abs_tol = TOLERANCE[dtype]
    assert not torch.isnan(case.out).any(), "some output rows were not written"
    assert case.rel_error() < rel_tol, f"relative error {case.rel_error():.2e} >= {rel_tol}"
    assert case.max_abs_error() < abs_tol, f"max abs error {case.max_abs_error():.2e} >= {abs_tol}"


SHAPES = {  # num_heads, num_kv_heads, head_size, block_size
    "mha-d64-b16": (4, 4, 64, 16),
    "gqa2-d128-b32": (4, 2, 128, 32),
    "gqa4-d80-b16": (8, 2, 80, 16),
    "gqa3-d32-b32": (6, 2, 32, 32),
}
# Every config on two shapes in fp16 and one in fp32 (each shape meets several configs).
MIXED_CASES = [
    ("gather", "mha-d64-b16", torch.float16),
    ("gather", "gqa4-d80-b16", torch.float16),
    ("gather", "gqa3-d32-b32", torch.float32),
    ("gather-pack", "gqa3-d32-b32", torch.float16),
    ("gather-pack", "gqa4-d80-b16", torch.float16),
    ("gather-pack", "gqa2-d128-b32", torch.float32),
    ("page", "gqa2-d128-b32", torch.float16),
    ("page", "gqa3-d32-b32", torch.float16),
    ("page", "mha-d64-b16", torch.float32),
    ("tma", "gqa2-d128-b32", torch.float16),
    ("tma", "mha-d64-b16", torch.float16),
    ("tma", "gqa3-d32-b32", torch.float32),
    ("tma-pack-ws", "gqa3-d32-b32", torch.float16),
    ("tma-pack-ws", "gqa2-d128-b32", torch.float16),
    ("tma-pack-ws", "gqa4-d80-b16", torch.float32),
    ("newkv", "gqa4-d80-b16", torch.float16),
    ("newkv", "gqa2-d128-b32", torch.float16),
    ("newkv", "mha-d64-b16", torch.float32),
    ("newkv-tma-pack", "gqa3-d32-b32", torch.float16),
    ("newkv-tma-pack", "mha-d64-b16", torch.float16),
    ("newkv-tma-pack", "gqa2-d128-b32", torch.float32),
]


@pytest.mark.parametrize(
    "config,shape,dtype", MIXED_CASES, ids=[f"{c}-{s}-{str(d)[6:]}" for c, s, d in MIXED_CASES]
)
def test_mixed_batch(config, shape, dtype) -> None:
    case = run_triton_case(QUERY_LENS, CONTEXT_LENS, *SHAPES[shape], dtype, prefill_config=CONFIGS[config])
    check(case, dtype)


@pytest.mark.parametrize(
    "sliding_window,logits_soft_cap,use_sinks,config",
    [
        (8, None, False, "gather"),
        (None, 5.0, False, "tma-pack-ws"),
        (None, None, True, "gather-pack"),
        (19, 10.0, True, "tma"),
        (1, None, True, "gather"),
        (1, 10.0, True, "tma-pack-ws"),
        (8, None, False, "newkv"),
        (19, 10.0, True, "newkv-tma-pack"),
    ],
    ids=[
        "window",
        "softcap",
        "sinks",
        "all",
        "window1-sinks",
        "window1-all-pack",
        "newkv-window",
        "newkv-all",
    ],
)
def test_features(sliding_window, logits_soft_cap, use_sinks, config) -> None:
    case = run_triton_case(
        QUERY_LENS, CONTEXT_LENS, 8, 2, 64, 16, torch.float16, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, use_sinks=use_sinks, prefill_config=CONFIGS[config],
    )  # fmt: skip
    check(case, torch.float16)


@pytest.mark.parametrize(
    "kv_cache_dtype,config", [("fp8_e4m3", "tma"), ("fp8_e5m2", "gather"), ("fp8_e4m3", "newkv-tma-pack")]
)
def test_fp8_kv_cache(kv_cache_dtype, config) -> None:
    case = run_triton_case(
        QUERY_LENS, CONTEXT_LENS, 8, 2, 64, 16, torch.float16, kv_cache_dtype=kv_cache_dtype, k_scale=0.37,
        v_scale=1.7, use_sinks=True, prefill_config=CONFIGS[config],
    )  # fmt: skip
    check(case, torch.float16)


def _direct(query_lens, context_lens, cfg, *, head_size=64, block_size=16, nan_tails=False, step_kv=False):
    """Call prefill_attention alone on a batch of prefill chunks; returns (out, reference, kv_load).

    `step_kv`: the step's K/V go to the kernel as strided key/value views of a fused qkv tensor and
    their cache slots hold NaN, so only a kernel reading them from there (cfg.new_kv) gets it right."""
    num_heads, num_kv_heads = 4, 2
    batch = make_paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_size, block_size,
                             dtype=torch.float32, seed=3)  # fmt: skip
    key_cache = torch.zeros(batch.num_blocks, block_size, num_kv_heads, head_size)
    value_cache = torch.zeros_like(key_cache)
    if nan_tails:  # the last page's slots past the sequence end hold NaN (stale data as far as we know)
        key_cache.fill_(float("nan"))
        value_cache.fill_(float("nan"))
    batch.fill_cache(key_cache, value_cache)
    md = batch.metadata
    for t, (k, v) in enumerate(zip(batch.new_keys, batch.new_values)):
        slot = int(md.slot_mapping[t])
        key_cache[slot // block_size, slot % block_size] = float("nan") if step_kv else k
        value_cache[slot // block_size, slot % block_size] = float("nan") if step_kv else v
    key = value = None
    if step_kv:
        qkv = torch.randn(md.num_actual_tokens, num_heads + 2 * num_kv_heads, head_size)
        key, value = qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
        key.copy_(batch.new_keys)
        value.copy_(batch.new_values)
    out = torch.full_like(batch.query, float("nan"))
    scale = head_size**-0.5
    kv_load = prefill_attention(
        out, batch.query, key_cache, value_cache, md.query_start_loc, md.seq_lens, md.block_table,
        seq_lo=0, seq_hi=md.num_reqs, num_tokens=md.num_actual_tokens, scale=scale, cfg=cfg, key=key, value=value,
    )  # fmt: skip
    ref = reference_attention(batch.query, batch.keys, batch.values, batch.query_lens, scale)
    return out, ref, kv_load


@pytest.mark.parametrize("config", ["page", "tma"])
def test_stale_page_tails_are_never_read(config) -> None:
    """NaN past the sequence end inside the last page must not reach the output (TMA reads whole tiles)."""
    out, ref, kv_load = _direct([23, 40], [0, 9], CONFIGS[config], nan_tails=True)
    assert kv_load == CONFIGS[config].kv_load
    assert not torch.isnan(out).any()
    assert ((out - ref).norm() / ref.norm()).item() < TOLERANCE[torch.float32][0]


@pytest.mark.parametrize("head_size,expect", [(64, "gather+rows-tma"), (80, "gather+rows")])
def test_new_kv_reads_the_step_inputs(head_size, expect) -> None:
    """With new_kv the chunk's own keys come from key/value (their cache slots are NaN here) and the
    cached prefix from the cache; a padded head dim takes pointer loads instead of TMA."""
    out, ref, kv_load = _direct([23, 40], [17, 0], CONFIGS["newkv"], head_size=head_size, step_kv=True)
    assert kv_load == expect
    assert not torch.isnan(out).any()
    assert ((out - ref).norm() / ref.norm()).item() < TOLERANCE[torch.float32][0]


def test_new_kv_shape_mismatch_is_an_error() -> None:
    cache = torch.zeros(4, 16, 2, 64)
    with pytest.raises(ValueError, match="must be"):
        prefill_cfgs.resolve_new_kv_load(
            CONFIGS["newkv"], torch.zeros(8, 4, 64), torch.zeros(8, 4, 64), cache
        )


def test_kv_load_fallbacks() -> None:
    tma = CONFIGS["tma"]
    cache = torch.zeros(4, 16, 2, 64)
    assert resolve_kv_load(tma, cache, cache, 64) == "tma"
    assert (
        resolve_kv_load(PrefillConfig(16, 32, 4, 1, kv_load="tma"), cache, cache, 64) == "gather"
    )  # tile > page
    assert resolve_kv_load(tma, cache[..., :48], cache[..., :48], 48) == "page"  # strided pages
    odd = torch.zeros(4, 16, 2, 80)
    assert resolve_kv_load(tma, odd, odd, 80) == "page"  # padded head dim: no TMA box
    out, ref, kv_load = _direct([30], [5], tma, head_size=80)
    assert kv_load == "page"
    assert ((out - ref).norm() / ref.norm()).item() < TOLERANCE[torch.float32][0]


def test_bad_config_is_an_error() -> None:
    with pytest.raises(ValueError, match="kv_load must be one of"):
        PrefillConfig(128, 64, 8, 3, kv_load="cp.async")
    with pytest.raises(ValueError, match="tile_n must be a power of two"):
        PrefillConfig(128, 48, 8, 3)


@pytest.mark.parametrize(
    "query_lens,switch,expect_prefill_kernel",
    [
        ([1, 200, 150], "1", True),
        ([1, 20, 30], "1", False),
        ([1, 200, 150], "0", False),
        ([1, 200, 150], None, False),  # auto: below AUTO_MIN_MEAN_QUERY_LEN (patched to 180 here)
        ([1, 200, 220], None, True),
        ([1, 200, 220], "0", False),
    ],
)
def test_kernel_choice(monkeypatch, query_lens, switch, expect_prefill_kernel) -> None:
    """With no override: the switch at 1 sends prefills averaging MIN_MEAN_QUERY_LEN+ tokens to the prefill
    kernel; unset (auto) only those averaging AUTO_MIN_MEAN_QUERY_LEN+ (shorter steps were slower with it
    end to end on an H100); at 0 none. Every choice matches the float32 reference."""
    if switch is None:
        monkeypatch.delenv("KVLLM_TRITON_PREFILL_KERNEL", raising=False)
    else:
        monkeypatch.setenv("KVLLM_TRITON_PREFILL_KERNEL", switch)
    monkeypatch.setattr(prefill_cfgs, "AUTO_MIN_MEAN_QUERY_LEN", 180)  # small, for the interpreter
    calls = []
    real = prefill_ops.prefill_attention
    monkeypatch.setattr(
        unified_ops, "prefill_attention", lambda *a, **k: calls.append(k["cfg"]) or real(*a, **k)
    )
    monkeypatch.setattr(
        unified_ops, "prefill_kernel_config", lambda *a: PrefillConfig(32, 16, 4, 1)
    )  # small tiles: fast in the interpreter
    case = run_triton_case(query_lens, [10] * len(query_lens), 4, 2, 32, 16, torch.float32)
    assert bool(calls) == expect_prefill_kernel
    check(case, torch.float32)


def test_kernel_switch_defaults_to_auto_and_rejects_other_values(monkeypatch) -> None:
    monkeypatch.delenv("KVLLM_TRITON_PREFILL_KERNEL", raising=False)
    assert prefill_cfgs.prefill_kernel_mode() == "auto"
    for switch, mode in (("auto", "auto"), ("1", "on"), ("0", "off")):
        monkeypatch.setenv("KVLLM_TRITON_PREFILL_KERNEL", switch)
        assert prefill_cfgs.prefill_kernel_mode() == mode
    monkeypatch.setenv("KVLLM_TRITON_PREFILL_KERNEL", "yes")
    with pytest.raises(ValueError, match="allowed auto .long chunks only, the default., 1 .on. or 0 .off."):
        prefill_cfgs.prefill_kernel_mode()


def test_routing_thresholds(monkeypatch) -> None:
    monkeypatch.delenv("KVLLM_TRITON_PREFILL_KERNEL", raising=False)
    auto = prefill_cfgs.AUTO_MIN_MEAN_QUERY_LEN
    assert prefill_cfgs.routes_to_prefill_kernel(2 * auto, 2)
    assert not prefill_cfgs.routes_to_prefill_kernel(2 * auto - 1, 2)
    assert not prefill_cfgs.routes_to_prefill_kernel(0, 0)
    monkeypatch.setenv("KVLLM_TRITON_PREFILL_KERNEL", "1")
    assert prefill_cfgs.routes_to_prefill_kernel(2 * prefill_cfgs.MIN_MEAN_QUERY_LEN, 2)
    monkeypatch.setenv("KVLLM_TRITON_PREFILL_KERNEL", "0")
    assert not prefill_cfgs.routes_to_prefill_kernel(100 * auto, 1)


def test_sweep_tiny_runs(tmp_path, monkeypatch) -> None:
    """benchmarks/h200/prefill_sweep.py on the CPU: candidates checked against float32, rows written."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "h200" / "prefill_sweep.py"
    spec = importlib.util.spec_from_file_location("prefill_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "prefill_sweep", sweep)  # its dataclasses look their module up
    spec.loader.exec_module(sweep)
    argv = [
        "--tiny",
        "--out-dir",
        str(tmp_path),
        "--shapes",
        "tiny 2x80",
        "--only",
        "default,newkv",
        "--peers",
        "sdpa",
    ]
    assert sweep.main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "prefill_sweep.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "env"
    got = {r["candidate"]: r for r in rows[1:]}
    assert set(got) == {"prefill default", "unified default", "prefill m32-n16 newkv", "SDPA (cpu default)"}
    assert all(r["status"] == "ok" and r["rel_error"] < 1e-5 for r in got.values()), got
