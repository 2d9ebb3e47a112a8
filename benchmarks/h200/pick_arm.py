"""Which arm of a nano-vllm A/B ran faster: prints its label (the first, the default, unless another's mean
output tokens per second is higher by more than --margin).

    python3 benchmarks/h200/pick_arm.py /tmp/b default plan [--margin 0.005]

Reads the nano records of <folder>/bench-nano-<label>-*.jsonl (fast_path_bench.py's), and prints each arm's
runs and mean to stderr.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path


def nano_rates(folder: Path, label: str) -> list[float]:
    rates = []
    for path in sorted(glob.glob(str(folder / f"bench-nano-{label}-*.jsonl"))):
        for line in open(path):
            record = json.loads(line)
            if record.get("bench") == "nano":
                rates.append(record["out_tok_per_s"])
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("labels", nargs="+")
    parser.add_argument("--margin", type=float, default=0.005)
    args = parser.parse_args()
    means = {}
    for label in args.labels:
        rates = nano_rates(args.folder, label)
        if rates:
            means[label] = sum(rates) / len(rates)
        print(f"{label}: {', '.join(f'{r:,.0f}' for r in rates) or 'no runs'}"
              f"{f' (mean {means[label]:,.0f})' if rates else ''}", file=sys.stderr)  # fmt: skip
    default = args.labels[0]
    best = max(means, key=means.get, default=default)
    if default in means and means[best] <= means[default] * (1 + args.margin):
        best = default
    print(best)


if __name__ == "__main__":
    main()
