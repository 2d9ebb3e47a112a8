"""Which TRITON_ATTN page layout ran nano-vllm faster in session13.sh's final1 call: prints NHD or HND.

    python3 benchmarks/h200/pick_layout.py /tmp/final1

Reads the bench-nano-<layout>-p0-*.jsonl records (prefill kernel off) and compares the layouts' mean output
tokens per second; NHD (the default) unless HND's mean is higher.
"""

from __future__ import annotations

import glob
import json
import sys
from pathlib import Path


def mean_tok_per_s(folder: Path, layout: str) -> float | None:
    rates = []
    for path in glob.glob(str(folder / f"bench-nano-{layout}-p0-*.jsonl")):
        for line in open(path):
            record = json.loads(line)
            if record.get("bench") == "nano":
                rates.append(record["out_tok_per_s"])
    return sum(rates) / len(rates) if rates else None


def main() -> None:
    folder = Path(sys.argv[1])
    nhd, hnd = mean_tok_per_s(folder, "NHD"), mean_tok_per_s(folder, "HND")
    print("HND" if nhd is not None and hnd is not None and hnd > nhd else "NHD")


if __name__ == "__main__":
    main()
