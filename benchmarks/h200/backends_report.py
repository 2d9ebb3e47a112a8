"""The summary of backends_session.sh: issue 23's targets met or not, from the raw files of one run.

python benchmarks/h200/backends_report.py OUT_DIR    # prints the table, writes OUT_DIR/report.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# (shape, metric, target, what it measures) for FLEX_ATTENTION, from issue 23.
FLEX_TARGETS = [
    ("decode b256 x ctx1k", "tbps", 2.5, "decode TB/s"),
    ("prefill 8x2048 causal", "tflops", 250.0, "prefill TFLOP/s"),
]


# TRITON_ATTN's, from the one-run table (attn-all.json): a fixed target, or "SDPA flash" to reach that peer.
TRITON_TARGETS = [
    ("prefill 8x2048 causal", "tflops", 350.0, "prefill TFLOP/s"),
    ("decode b1 x ctx32k", "tbps", "SDPA flash", "batch-1 long-context decode TB/s"),
]


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def flex_rows(bench: dict | None) -> list[dict]:
    """FLEX_ATTENTION's value per target shape beside torch's compiled FlexAttention and SDPA."""
    rows = []
    for shape, metric, target, what in FLEX_TARGETS:
        found = [r for r in (bench or {}).get("rows", []) if r["shape"] == shape]
        ours = next((r for r in found if r["kernel"] == "FLEX_ATTENTION"), None)
        value = ours.get(metric) if ours else None
        peers = {r["kernel"]: r.get(metric) for r in found if r["kernel"] != "FLEX_ATTENTION"}
        rows.append({
            "shape": shape, "metric": what, "target": target, "FLEX_ATTENTION": value,
            "status": ours["status"] if ours else "missing", "peers": peers,
            "met": value is not None and value >= target,
        })  # fmt: skip
    return rows


def triton_rows(table: dict | None) -> list[dict]:
    """TRITON_ATTN's value per target shape of the one-run table, the target resolved (a peer's value)."""
    rows = []
    for shape, metric, target, what in TRITON_TARGETS:
        found = {r["kernel"]: r for r in (table or {}).get("rows", []) if r["shape"] == shape}
        ours = found.get("TRITON_ATTN")
        value = ours.get(metric) if ours else None
        bound = found.get(target, {}).get(metric) if isinstance(target, str) else target
        rows.append({
            "shape": shape, "metric": what, "target": target, "target_value": bound, "TRITON_ATTN": value,
            "status": ours["status"] if ours else "missing",
            "met": value is not None and bound is not None and value >= bound,
        })  # fmt: skip
    return rows


def autotune_rows(directory: Path) -> list[dict]:
    rows = []
    for run in (1, 2):
        data = _load(directory / f"autotune-{run}.json")
        if data is None:
            rows.append({"run": run, "status": "missing"})
            continue
        # A total only for a backend timed on every shape; a partial sum (a time cap) would read as its total.
        totals = {
            r["backend"]: sum(r["ms"].values()) if r["status"] == "ok" else r["status"] for r in data["rows"]
        }
        rows.append({"run": run, "chosen": data["chosen"], "from_cache": data["from_cache"], "why": data["why"],
                     "totals_ms_or_status": totals})  # fmt: skip
    return rows


def main(argv: list[str]) -> int:
    directory = Path(argv[0] if argv else ".")
    report = {
        "flex_targets": flex_rows(_load(directory / "flex-bench.json")),
        # The same targets in the one-run table, where every backend and peer ran in one process.
        "flex_targets_one_run": flex_rows(_load(directory / "attn-all.json")),
        "triton_targets": triton_rows(_load(directory / "attn-all.json")),
        "autotune": autotune_rows(directory),
        "walks": {
            name: {"declare": data.get("declare", [])}
            for name, data in ((_load(directory / "walk-summary.json") or {}).get("backends", {})).items()
        },
    }
    (directory / "report.json").write_text(json.dumps(report, indent=1))
    for key, source in (
        ("flex_targets", "flex-bench.json"),
        ("flex_targets_one_run", "the one-run table, attn-all.json"),
    ):
        print(f"FLEX_ATTENTION targets (issue 23; {source}):")
        for row in report[key]:
            value = "-" if row["FLEX_ATTENTION"] is None else f"{row['FLEX_ATTENTION']:.3f}"
            peers = ", ".join(f"{k} {v:.3f}" for k, v in row["peers"].items() if v is not None)
            verdict = "MET" if row["met"] else "NOT MET"
            print(
                f"  {row['shape']}: {row['metric']} {value} (target >= {row['target']}) {verdict}; peers: {peers}"
            )
    print("TRITON_ATTN targets (issue 23; the one-run table, attn-all.json):")
    for row in report["triton_targets"]:
        value = "-" if row["TRITON_ATTN"] is None else f"{row['TRITON_ATTN']:.3f}"
        bound = "-" if row["target_value"] is None else f"{row['target_value']:.3f}"
        target = row["target"] if isinstance(row["target"], str) else "target"
        verdict = "MET" if row["met"] else "NOT MET"
        print(f"  {row['shape']}: {row['metric']} {value} ({target} {bound}) {verdict} [{row['status']}]")
    print("auto-tune on Qwen3-0.6B shapes:")
    for row in report["autotune"]:
        print(f"  run {row['run']}: " + json.dumps({k: v for k, v in row.items() if k != "run"}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
