"""How fast the host CPU runs Python right now: a fixed pure-Python loop (no kvllm, no torch), timed.

    python3 benchmarks/h200/host_probe.py --csv FILE [--every-s 5]     # one line per probe, until killed

A fresh H200 machine's host ran this loop at about half speed for its first ~2 minutes (ninth session),
which slowed every host-bound measurement taken then. fast_path_bench.py records one probe before each
batch-1 run; session_lib.sh runs this in the background of every call.
"""

from __future__ import annotations

import argparse
import time


def host_cpu_probe_ms() -> float:
    """Milliseconds for a fixed loop of 200,000 additions: slower means the host CPU itself is slower
    (clock, a busy sibling), whatever kvllm does."""
    started = time.perf_counter()
    total = 0
    for i in range(200_000):
        total += i & 7
    return round((time.perf_counter() - started) * 1e3, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", required=True)
    parser.add_argument("--every-s", type=float, default=5.0)
    args = parser.parse_args()
    with open(args.csv, "w", buffering=1) as out:
        out.write("unix_s,probe_ms\n")
        while True:
            out.write(f"{time.time():.1f},{host_cpu_probe_ms()}\n")
            time.sleep(args.every_s)


if __name__ == "__main__":
    main()
