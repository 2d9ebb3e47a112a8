"""A throughput run's decode steps as a fixed cost per step plus a KV-read cost, from its step log.

    python3 benchmarks/step_log_fit.py STEPS.json [--kv-bytes-per-token 114688]

STEPS.json is the list `fast_path_bench.py --step-log` writes (benchmarks/h200/step_log.py: per step its
host wall time `ms`, requests `reqs`, context tokens `context`, `decode_only`). Runs on the CPU over a
finished run's file. The decode-only steps are fitted by least squares as ms = fixed + per_request * reqs
+ per_context_token * context (and without the request term). The context term, read as the
time to read the KV cache, gives a rate: --kv-bytes-per-token (default Qwen3-0.6B in bf16:
28 layers x K and V x 8 heads x 128 x 2 bytes). The fit is rough (requests and context grow together
in such a run): it says how much of the decode time does not scale with the KV read, not which kernels
spend it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

QWEN3_0_6B_KV_BYTES_PER_TOKEN = 28 * 2 * 8 * 128 * 2
BUCKETS = ((1, 1), (2, 16), (17, 64), (65, 128), (129, 256), (257, 1 << 30))


def fit(steps: list[dict], with_requests: bool) -> tuple[np.ndarray, float]:
    """Least-squares coefficients (fixed, [per request,] per context token) in ms, and the residual RMS."""
    columns = [[1.0] * len(steps)]
    if with_requests:
        columns.append([s["reqs"] for s in steps])
    columns.append([s["context"] for s in steps])
    x = np.array(columns, dtype=float).T
    y = np.array([s["ms"] for s in steps], dtype=float)
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    return coef, float(np.sqrt(np.mean((y - x @ coef) ** 2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("steps", type=Path)
    parser.add_argument("--kv-bytes-per-token", type=int, default=QWEN3_0_6B_KV_BYTES_PER_TOKEN)
    args = parser.parse_args()

    decode = [s for s in json.loads(args.steps.read_text()) if s["decode_only"]]
    total = sum(s["ms"] for s in decode)
    print(f"{args.steps.name}: {len(decode)} decode steps, {total:.0f} ms")
    for with_requests in (False, True):
        coef, rms = fit(decode, with_requests)
        fixed, per_context = coef[0], coef[-1]
        rate = args.kv_bytes_per_token / (per_context * 1e-3) / 1e12
        terms = f"fixed {fixed:.3f} ms/step"
        if with_requests:
            terms += f", {coef[1] * 1e3:.2f} us/request"
        print(
            f"  fit ({'with' if with_requests else 'without'} a request term): {terms}, "
            f"{per_context * 1e6:.2f} ns/context token (KV read at {rate:.2f} TB/s); residual RMS {rms:.3f} ms; "
            f"fixed part {fixed * len(decode):.0f} ms of {total:.0f}"
        )
    print(
        f"  {'requests':>10} {'steps':>6} {'ms':>7} {'ms/step':>8} {'context/step':>13} {'KV TB/s if all KV':>18}"
    )
    for low, high in BUCKETS:
        part = [s for s in decode if low <= s["reqs"] <= high]
        if not part:
            continue
        ms = sum(s["ms"] for s in part)
        context = sum(s["context"] for s in part)
        rate = context * args.kv_bytes_per_token / (ms * 1e-3) / 1e12
        label = f"{low}-{high}" if high < 1 << 30 else f"{low}+"
        print(
            f"  {label:>10} {len(part):>6} {ms:>7.0f} {ms / len(part):>8.3f} {context / len(part):>13.0f} {rate:>18.2f}"
        )


if __name__ == "__main__":
    main()
