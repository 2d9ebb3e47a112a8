"""benchmarks/h200/decode_plan_sweep.py: the plan it writes, and one tiny sweep on the Triton interpreter."""

from __future__ import annotations

import json

from benchmarks.h200.decode_plan_sweep import main, plan_entry
from kvllm.attention.backends.triton_attn_impl import decode_plan_setting


def _row(tile_n, splits, ordered, ms, default=False):
    return {"tile_n": tile_n, "warps": 2, "stages": 3, "splits": splits, "ordered": ordered, "ms": ms,
            "default": default}  # fmt: skip


def test_plan_entry_keeps_the_default_unless_the_best_clearly_wins() -> None:
    default = _row(64, 1, True, 1.00, default=True)
    clear = {"num_reqs": 48, "default": default, "best": _row(32, 4, True, 0.90)}
    close = {"num_reqs": 48, "default": default, "best": _row(32, 4, True, 0.98)}
    assert plan_entry(clear, 0.03) == "48:32,2,3,4,o"
    assert plan_entry(close, 0.03) == "48:64,2,3,1"  # within the margin: the default's own settings
    failed = {
        "num_reqs": 8,
        "default": {**default, "ms": None} | {"error": "x"},
        "best": _row(32, 2, False, 1.0),
    }
    del failed["default"]["ms"]
    assert plan_entry(failed, 0.03) == "8:32,2,3,2"


def test_tiny_sweep_on_the_interpreter(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out, plan = tmp_path / "sweep.json", tmp_path / "plan.txt"
    argv = ["--batches", "2", "--ctx-lo", "20", "--ctx-hi", "60", "--splits", "1,2", "--tiles", "16",
            "--warps", "2", "--stages", "1", "--l2-flush-bytes", "1", "--max-model-len", "1024",
            "--out", str(out), "--plan-out", str(plan)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())["results"][0]
    timed = [r for r in result["rows"] if "ms" in r]
    assert len(timed) == len(result["rows"]) == 4  # the default and 3 candidates, all within tolerance
    assert all(r["rel_err"] < 1.5e-2 for r in timed)
    monkeypatch.setenv("KVLLM_TRITON_DECODE_PLAN", plan.read_text().strip())
    (entry,) = decode_plan_setting()  # the written plan parses as the engine reads it
    assert entry.max_reqs == 2
