"""The 1-4 row GEMV kernel (kvllm/layers/ops/gemv.py) against F.linear and the small-M tensor-core kernel.

    PYTHONPATH=. python3 benchmarks/h200/gemv_bench.py --out DIR

Qwen3-0.6B's four projections (bf16), M = 1 and 4, timed as in linear_bench.py (CUDA graphs of calls
on cold weight copies). The GEMV runs a sweep of columns per program, K tile, warps and stages; the
best per shape and M is printed beside cuBLAS and the tensor-core kernel. JSON lines in DIR/gemv_bench.jsonl.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.h200.linear_bench import COLD_BYTES, SHAPES, graph_us  # noqa: E402

# block_n, block_k, warps, stages: wide K tiles, few warps and narrow column blocks won the first
# sweep (2, 4, 8, 16 x 512, 1024 x 4, 8 warps x 1, 3 stages; docs/benchmarks/h200/fast-path/7-gemv/).
SWEEP = list(itertools.product((1, 2, 4, 8), (1024, 2048, 4096), (1, 2, 4), (1,)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="the default config only (no sweep)")
    args = parser.parse_args()
    from kvllm.layers.ops.activation import silu_and_mul
    from kvllm.layers.ops.gemv import GemvConfig, default_config, gemv, gemv_silu_and_mul
    from kvllm.layers.ops.linear import linear, use_small_m_kernel

    args.out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16
    rows = []
    log = (args.out / "gemv_bench.jsonl").open("w")
    for name, (n, k) in SHAPES.items():
        w_bytes = n * k * dtype.itemsize
        weights = [
            torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5 for _ in range(-(-COLD_BYTES // w_bytes))
        ]
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = F.linear(x, weights[0]).float()
            gb = (w_bytes + (m * k + m * n) * dtype.itemsize) / 1e9
            base = {"shape": name, "n": n, "k": k, "m": m}
            results = [
                base | {"impl": "torch", "us": graph_us(lambda i, x=x, w=weights: F.linear(x, w[i % len(w)]))}
            ]
            if use_small_m_kernel(x, weights[0]):
                us = graph_us(lambda i, x=x, w=weights: linear(x, w[i % len(w)]))
                results.append(base | {"impl": "small_m", "us": us})
            if name == "gate_up":  # the projection then the activation kernel, against one fused launch
                results.append(
                    base
                    | {
                        "impl": "gemv+silu",
                        "us": graph_us(lambda i, x=x, w=weights: silu_and_mul(gemv(x, w[i % len(w)]))),
                    }
                )
                results.append(
                    base
                    | {
                        "impl": "gemv_silu_fused",
                        "us": graph_us(lambda i, x=x, w=weights: gemv_silu_and_mul(x, w[i % len(w)])),
                    }
                )
            default = default_config(n, k, dtype)
            for config in [default] + [GemvConfig(*c) for c in ([] if args.quick else SWEEP)]:
                err = (
                    gemv(x, weights[0], config=config).float() - ref
                ).abs().max().item() / ref.abs().max().item()
                us = graph_us(lambda i, c=config, x=x, w=weights: gemv(x, w[i % len(w)], config=c))
                results.append(
                    base
                    | {
                        "impl": "gemv",
                        "config": asdict(config),
                        "default": config == default,
                        "us": us,
                        "rel_err": err,
                    }
                )
            for r in results:
                r["gbps"] = gb / r["us"] * 1e6
                log.write(json.dumps(r) + "\n")
            log.flush()
            rows += results
            best = min((r for r in results if r["impl"] == "gemv"), key=lambda r: r["us"])
            dflt = next(r for r in results if r.get("default"))
            others = "  ".join(f"{r['impl']} {r['us']:.2f}" for r in results if r["impl"] != "gemv")
            c = best["config"]
            print(
                f"{name:8s} M={m}: {others} | gemv default {dflt['us']:.2f} | best {best['us']:.2f} us "
                f"{best['gbps']:.0f} GB/s n{c['block_n']} k{c['block_k']} w{c['num_warps']} s{c['num_stages']} "
                f"err {best['rel_err']:.1e}",
                flush=True,
            )
    worst = max(r["rel_err"] for r in rows if r["impl"] == "gemv")
    print(
        f"largest GEMV - F.linear difference: {worst:.1e} of max |y| ({'ok' if worst <= 2**-7 else 'TOO LARGE'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
