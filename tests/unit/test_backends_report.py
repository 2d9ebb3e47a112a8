"""issue 23's report of a backends call (benchmarks/h200/backends_report.py): targets read from the raw tables."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def report():
    spec = importlib.util.spec_from_file_location(
        "backends_report", ROOT / "benchmarks/h200/backends_report.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(shape: str, kernel: str, **metrics: float) -> dict:
    return {"shape": shape, "kernel": kernel, "status": "ok", **metrics}


def test_triton_targets_fixed_and_against_a_peer(report) -> None:
    table = {"rows": [
        row("prefill 8x2048 causal", "TRITON_ATTN", tflops=351.0),
        row("prefill 8x2048 causal", "SDPA flash", tflops=400.0),
        row("decode b1 x ctx32k", "TRITON_ATTN", tbps=1.4),
        row("decode b1 x ctx32k", "SDPA flash", tbps=1.5),
    ]}  # fmt: skip
    prefill, decode = report.triton_rows(table)
    assert (
        prefill["met"] and prefill["target_value"] == 350.0
    )  # a peer's faster row does not move a fixed target
    assert not decode["met"] and decode["target_value"] == 1.5 and decode["TRITON_ATTN"] == 1.4


def test_triton_targets_missing_rows_are_not_met(report) -> None:
    rows = report.triton_rows({"rows": [row("decode b1 x ctx32k", "TRITON_ATTN", tbps=9.0)]})
    assert [(r["status"], r["met"]) for r in rows] == [
        ("missing", False),
        ("ok", False),
    ]  # no SDPA row to reach
    assert [r["met"] for r in report.triton_rows(None)] == [False, False]


def test_report_json_and_printout(report, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = {"rows": [row("prefill 8x2048 causal", "TRITON_ATTN", tflops=300.0)]}
    (tmp_path / "attn-all.json").write_text(json.dumps(table))
    assert report.main([str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["triton_targets"][0]["TRITON_ATTN"] == 300.0 and not saved["triton_targets"][0]["met"]
    assert (
        "prefill 8x2048 causal: prefill TFLOP/s 300.000 (target 350.000) NOT MET [ok]"
        in capsys.readouterr().out
    )


def test_flex_targets_from_the_bench_and_from_the_one_run_table(
    report, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = {"rows": [row("decode b256 x ctx1k", "FLEX_ATTENTION", tbps=2.1)]}
    table = {"rows": [
        row("decode b256 x ctx1k", "FLEX_ATTENTION", tbps=2.8),
        row("decode b256 x ctx1k", "SDPA flash", tbps=1.2),
        row("prefill 8x2048 causal", "FLEX_ATTENTION", tflops=249.0),
    ]}  # fmt: skip
    (tmp_path / "flex-bench.json").write_text(json.dumps(bench))
    (tmp_path / "attn-all.json").write_text(json.dumps(table))
    assert report.main([str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "report.json").read_text())
    assert [(r["FLEX_ATTENTION"], r["met"]) for r in saved["flex_targets"]] == [(2.1, False), (None, False)]
    decode, prefill = saved["flex_targets_one_run"]
    assert decode["met"] and decode["peers"] == {"SDPA flash": 1.2} and not prefill["met"]
    out = capsys.readouterr().out
    assert "FLEX_ATTENTION targets (issue 23; the one-run table, attn-all.json):" in out
    assert "decode b256 x ctx1k: decode TB/s 2.800 (target >= 2.5) MET; peers: SDPA flash 1.200" in out


def test_autotune_totals_only_for_backends_timed_on_every_shape(report, tmp_path: Path) -> None:
    """A backend cut off by auto-tune's time cap reports its status, not the sum of the shapes it reached (the
    H200's FLEX_ATTENTION row had one shape, 0.31 ms, below every full total)."""
    rows = [
        {"backend": "TRITON_ATTN", "status": "ok", "ms": {"a": 0.25, "b": 0.5}},
        {"backend": "FLEX_ATTENTION", "status": "not_timed", "ms": {"a": 0.31}},
        {"backend": "CPU_ATTN", "status": "invalid", "ms": {}},
    ]
    data = {"chosen": "TRITON_ATTN", "from_cache": False, "why": "fastest", "rows": rows}
    (tmp_path / "autotune-1.json").write_text(json.dumps(data))
    first, second = report.autotune_rows(tmp_path)
    assert first["totals_ms_or_status"] == {
        "TRITON_ATTN": 0.75,
        "FLEX_ATTENTION": "not_timed",
        "CPU_ATTN": "invalid",
    }
    assert second == {"run": 2, "status": "missing"}
