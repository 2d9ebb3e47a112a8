"""benchmarks/h200/prefill_routing.py: its case parsing and summary (the GPU timing runs on the H200)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest


@pytest.fixture
def routing(monkeypatch):
    path = Path(__file__).parents[2] / "benchmarks" / "h200" / "prefill_routing.py"
    spec = importlib.util.spec_from_file_location("prefill_routing", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "prefill_routing", module)
    spec.loader.exec_module(module)
    return module


def test_parse_case(routing):
    assert routing.parse_case("8x2048") == (8, 2048)
    assert routing.parse_case("1X512") == (1, 512)


def test_summary_takes_the_median_of_each_setting_and_the_speed_up_over_the_unified_kernel(routing):
    records = [
        {"prefill_kernel": "1", "case": "8x2048", "median_ms": 10.0},
        {"prefill_kernel": "0", "case": "8x2048", "median_ms": 15.0},
        {"prefill_kernel": "1", "case": "8x2048", "median_ms": 12.0},
        {"prefill_kernel": "0", "case": "8x2048", "median_ms": 13.0},
        {"prefill_kernel": "1", "case": "1x512", "median_ms": 4.0},  # no unified run: no speed-up
    ]
    lines = routing.summary(records).splitlines()
    assert len(lines) == 3
    case, on, on_x, off, off_x = lines[1].split()
    assert (case, float(on), float(off)) == ("8x2048", 11.0, 14.0)
    assert (on_x, off_x) == (f"{14.0 / 11.0:.3f}x", "1.000x")
    assert lines[2].split() == ["1x512", "4.000", "-", "-", "-"]


def test_a_moved_auto_threshold_runs_as_its_own_setting_on_the_cpu(
    routing, tiny_qwen3_path, tmp_path, monkeypatch
):
    """auto@N runs one engine with the auto route's threshold at N (the smoke run on the CPU checks the
    plumbing: the child gets the threshold and labels its records with it); a malformed setting is refused."""
    argv = ["prefill_routing.py", "--out", str(tmp_path), "--model", str(tiny_qwen3_path), "--cases", "1x24",
            "--order", "auto@16,0", "--iters", "1", "--warmups", "0", "--timeout-s", "120"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert routing.main() == 0
    lines = (tmp_path / "prefill_routing.jsonl").read_text().splitlines()
    assert [json.loads(line)["prefill_kernel"] for line in lines] == ["auto@16", "0"]
    for bad in ("1@16", "auto@x", "auto@0", "0,auto@x"):  # the last: refused before engine 0 starts
        monkeypatch.setattr(sys, "argv", [*argv[:-8], "--order", bad])
        with pytest.raises(SystemExit, match="auto@TOKENS"):
            routing.main()
        assert (tmp_path / "prefill_routing.jsonl").read_text().splitlines() == lines  # nothing ran
