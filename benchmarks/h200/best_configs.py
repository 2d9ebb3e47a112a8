"""The fastest TRITON_ATTN tile configs per shape from an attention sweep (`kvllm.benchmarks.attention
--sweep --output-json F`), against the shape-chosen default:

    python3 benchmarks/h200/best_configs.py F.json [--top 5]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report")
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    with open(args.report) as f:
        rows = json.load(f)["rows"]
    by_shape: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row["kernel"].startswith("TRITON_ATTN") and row["status"] == "ok" and row["ms"]:
            by_shape[row["shape"]].append(row)
    for shape, found in by_shape.items():
        default = next((r for r in found if r["kernel"] == "TRITON_ATTN"), None)
        print(
            f"== {shape}: default {default['ms']:.4f} ms, {default['tbps']:.2f} TB/s"
            if default
            else f"== {shape}"
        )
        for r in sorted(found, key=lambda r: r["ms"])[: args.top]:
            ratio = f"{default['ms'] / r['ms']:.2f}x" if default else ""
            print(
                f"   {r['kernel']:<36} {r['ms']:.4f} ms {r['tbps']:.2f} TB/s {r['tflops']:.0f} TFLOP/s {ratio}"
            )


if __name__ == "__main__":
    main()
