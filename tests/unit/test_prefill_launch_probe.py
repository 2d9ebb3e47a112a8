"""benchmarks/h200/prefill_launch_probe.py in the Triton interpreter (its GPU timings run on the H200)."""

import importlib.util
import json
import sys
from pathlib import Path


def test_the_probe_times_every_prefill_path_in_the_interpreter(tmp_path, monkeypatch):
    path = Path(__file__).parents[2] / "benchmarks" / "h200" / "prefill_launch_probe.py"
    spec = importlib.util.spec_from_file_location("prefill_launch_probe", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "prefill_launch_probe", module)
    spec.loader.exec_module(module)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(sys, "argv", ["prefill_launch_probe.py", "--out", str(tmp_path), "--smoke"])
    assert module.main() == 0
    records = [
        json.loads(line) for line in (tmp_path / "prefill_launch_probe.jsonl").read_text().splitlines()
    ]
    assert [r["variant"] for r in records] == [
        "unified", "prefill", "prefill-gatherkv", "prefill-cacheonly", "descriptors"
    ]  # fmt: skip
    assert all(r["case"] == "2x24" and r["host_us"] > 0 and r["gpu_us"] is None for r in records)
    for variant in ("unified", "prefill", "prefill-cacheonly"):  # the launches' host time by function
        text = (tmp_path / f"probe-profile-{variant}.txt").read_text()
        assert text.startswith(f"{variant}, 1 calls") and "unified_attention" in text
