"""The GPU conformance walk's bookkeeping on the CPU: case records, resuming, the summary and the
FLASHINFER declaration lines it prints (benchmarks/h200/backend_walk.py; the kernels run on the H200)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def walk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location(
        "backend_walk", ROOT / "benchmarks" / "h200" / "backend_walk.py"
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "backend_walk", module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "STATE", tmp_path / "state")
    return module


TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}


def fake_run_case(errors: dict):
    def run(dtype, kv, head, block, feature):
        value = errors[(head, block, feature)]
        if isinstance(value, Exception):
            raise value
        return value

    return run


def recording_run_case(ran: list):
    """A run_case that passes every case and appends each case it runs to `ran`."""

    def run(*case):
        ran.append(case)
        return 1e-3

    return run


def test_records_pass_fail_error_and_deadline(walk, tmp_path: Path) -> None:
    cases = [("bfloat16", "auto", 64, 16, "none"), ("bfloat16", "auto", 64, 32, "none"),
             ("bfloat16", "auto", 128, 16, "window")]  # fmt: skip
    errors = {(64, 16, "none"): 1e-3, (64, 32, "none"): 0.5, (128, 16, "window"): RuntimeError("no kernel")}
    out = tmp_path / "out" / "walk-x.jsonl"
    walk.walk_cases("FLASHINFER", cases, set(), fake_run_case(errors), TOL, out, time.monotonic() + 60)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["status"] for r in rows] == ["pass", "fail", "error"]
    assert rows[1]["rel_max_error"] == 0.5 and rows[1]["tolerance"] == 2e-2
    assert "no kernel" in rows[2]["error"]
    late = tmp_path / "out" / "walk-late.jsonl"
    walk.walk_cases("FLASHINFER", cases, set(), fake_run_case(errors), TOL, late, time.monotonic() - 1)
    assert {json.loads(line)["status"] for line in late.read_text().splitlines()} == {"not_run"}


def test_a_rerun_skips_what_already_ran(walk, tmp_path: Path) -> None:
    case = ("bfloat16", "auto", 64, 16, "none")
    out = tmp_path / "out1" / "walk-x.jsonl"
    walk.walk_cases(
        "FLASHINFER", [case], set(), fake_run_case({(64, 16, "none"): 1e-3}), TOL, out, time.monotonic() + 60
    )
    again = tmp_path / "out2" / "walk-x.jsonl"
    walk.walk_cases(
        "FLASHINFER", [case], set(), fake_run_case({}), TOL, again, time.monotonic() + 60
    )  # would KeyError
    row = json.loads(again.read_text())
    assert row["status"] == "pass" and row["from_earlier_run"]


def test_a_fresh_machine_skips_what_an_earlier_lease_committed(
    walk, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    passed, failed, errored = (("bfloat16", "auto", 64, b, "none") for b in (16, 32, 64))
    errors = {(64, 16, "none"): 1e-3, (64, 32, "none"): 0.5, (64, 64, "none"): RuntimeError("no kernel")}
    earlier = tmp_path / "committed" / "walk-flashinfer-0of5.jsonl"
    walk.walk_cases("FLASHINFER", [passed, failed, errored], set(), fake_run_case(errors), TOL, earlier,
                    time.monotonic() + 60)  # fmt: skip
    monkeypatch.setattr(walk, "STATE", tmp_path / "fresh-machine")
    monkeypatch.setenv("KVLLM_WALK_DONE", f"{tmp_path / 'nothing-here'}:{earlier.parent}")
    out = tmp_path / "out" / "walk-flashinfer-1of5.jsonl"
    ran = []
    walk.walk_cases(
        "FLASHINFER",
        [passed, failed, errored],
        set(),
        recording_run_case(ran),
        TOL,
        out,
        time.monotonic() + 60,
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [case[3] for case in ran] == [64]  # an error is run again; a pass or a fail is a result
    assert [(r["status"], r.get("from_earlier_run", False)) for r in rows] == [
        ("pass", True),
        ("fail", True),
        ("pass", False),
    ]


def test_a_cache_named_like_the_model_dtype_reuses_the_auto_result(walk, tmp_path: Path) -> None:
    """`auto` and `bfloat16` caches of a bfloat16 model build one FlashInfer module: one result for both."""
    auto, named = ("bfloat16", "auto", 64, 16, "none"), ("bfloat16", "bfloat16", 64, 16, "none")
    e5m2 = ("bfloat16", "fp8_e5m2", 64, 16, "none")
    out = tmp_path / "out" / "walk-x.jsonl"
    ran = []
    walk.walk_cases(
        "FLASHINFER", [auto, named, e5m2], set(), recording_run_case(ran), TOL, out, time.monotonic() + 60
    )
    assert [case[1] for case in ran] == ["auto", "fp8_e5m2"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert (
        rows[1]["case"] == "FLASHINFER/bfloat16/bfloat16/64/16/none"
        and rows[1]["kv_cache_dtype"] == "bfloat16"
    )
    assert rows[1]["status"] == "pass" and rows[1]["ran_as"] == "FLASHINFER/bfloat16/auto/64/16/none"


def test_summary_declares_only_what_passed_completely(walk, tmp_path: Path) -> None:
    cases = [
        ("bfloat16", "auto", h, b, f) for h in (64, 128, 256) for b in (16, 64) for f in ("none", "window")
    ]
    errors = {(h, b, f): 1e-3 for _, _, h, b, f in cases}
    errors[(256, 64, "window")] = 0.9  # one failure rules out head 256, block 64 and the window
    out = tmp_path / "walk-flashinfer-0of1.jsonl"
    walk.walk_cases("FLASHINFER", cases, set(), fake_run_case(errors), TOL, out, time.monotonic() + 60)
    summary = walk.summarize(tmp_path)["backends"]["FLASHINFER"]
    assert summary["axes"]["head_size"]["256"] == {"pass": 3, "fail": 1, "error": 0, "not_run": 0, "cases": 4,
                                                   "all_passed": False, "declared": False}  # fmt: skip
    assert summary["declare"] == [
        "VERIFIED_HEAD_SIZES = (64, 128)",
        "VERIFIED_BLOCK_SIZES = (16,)",
        "VERIFIED_SLIDING_WINDOW = False",
        "VERIFIED_LOGITS_SOFT_CAP = False",
    ]
    assert summary["first_failures"][0]["case"] == "FLASHINFER/bfloat16/auto/256/64/window"


def test_compile_groups_put_the_widening_bf16_groups_first(walk) -> None:
    ranks = [walk._group_rank(("bfloat16", "auto", h, 16, f)) for h, f in walk.HEAD_FEATURE_ORDER[:5]]
    assert ranks == sorted(ranks) and max(ranks) < walk._group_rank(("bfloat16", "fp8_e4m3", 128, 16, "none"))
    assert walk._group_rank(("bfloat16", "fp8", 64, 16, "none")) == walk._group_rank(
        ("bfloat16", "fp8_e4m3", 64, 32, "none")
    )  # one FlashInfer module for both names of e4m3, any block size
    assert walk._group_rank(("float16", "auto", 128, 16, "none")) > walk._group_rank(
        ("bfloat16", "fp8_e5m2", 256, 16, "softcap")
    )


def test_summary_counts_a_stopped_walks_missing_cases_and_declares_per_dtype_pair(
    walk, tmp_path: Path
) -> None:
    """A walk killed by its call's time limit writes no not_run lines: the expected cases without a line
    must not widen anything, and what one (model dtype, cache dtype) pair passed completely is its own line."""
    bf16 = [("bfloat16", "auto", h, b, f) for h in (64, 128) for b in (16, 64) for f in ("none", "window")]
    fp16 = [("float16", "auto", h, b, f) for h in (64, 128) for b in (16, 64) for f in ("none", "window")]
    ran = bf16 + fp16[:3]  # the float16 half stopped after three cases
    errors = {(h, b, f): 1e-3 for _, _, h, b, f in ran}
    out = tmp_path / "walk-flashinfer-0of1.jsonl"
    walk.walk_cases("FLASHINFER", ran, set(), fake_run_case(errors), TOL, out, time.monotonic() + 60)
    # bfloat16 with kv "bfloat16" runs the same module as kv "auto": counted as run through it
    expected = bf16 + fp16 + [("bfloat16", "bfloat16", 64, 16, "none")]
    summary = walk.summarize(tmp_path, {"FLASHINFER": expected})["backends"]["FLASHINFER"]
    assert summary["axes"]["dtype"]["float16"] == {"pass": 3, "fail": 0, "error": 0, "not_run": 5, "cases": 8,
                                                   "all_passed": False, "declared": False}  # fmt: skip
    assert summary["declare"][0] == "VERIFIED_HEAD_SIZES = ()"
    assert summary["declare_by_dtypes"] == [
        "('bfloat16', 'bfloat16'): VerifiedAxes((64, 128), (16, 64), True, False),",
        "('float16', 'float16'): VerifiedAxes((), (), False, False),",
    ]
    assert (
        walk.summarize(tmp_path)["backends"]["FLASHINFER"]["declare"][0] == "VERIFIED_HEAD_SIZES = (64, 128)"
    )
