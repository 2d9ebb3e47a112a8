"""Fused-MoE timing on a CUDA GPU: the Triton grouped GEMMs vs the per-expert torch loop (bf16).

`PYTHONPATH=. python benchmarks/h200/fused_moe_bench.py --out $OUT/fused_moe.json` writes one record per
(shape, tokens) with both paths' median microseconds (CUDA events, 20 timed repeats after 3 warm-ups)
and the max abs difference between them, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from kvllm.layers.moe import fused_experts_torch, softmax_topk
from kvllm.layers.moe.fused_moe_triton import fused_experts_triton

SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b/4": (8, 2, 4096, 3584),
    "gpt-oss-20b": (32, 4, 2880, 2880),
}
TOKENS = (1, 16, 256, 2048)


def time_us(fn, args: tuple, repeats: int = 20) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    records = []
    gen = torch.Generator("cuda").manual_seed(0)
    for name, (experts, top_k, hidden, inter) in SHAPES.items():
        w13 = (
            torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden**-0.5
        ).bfloat16()
        w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter**-0.5).bfloat16()
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
            tw, ti = softmax_topk(torch.randn(tokens, experts, device="cuda", generator=gen), top_k, True)
            triton_out = fused_experts_triton(x, w13, w2, tw, ti)
            torch_out = fused_experts_torch(x, w13, w2, tw, ti)
            record = dict(
                shape=name, experts=experts, top_k=top_k, hidden=hidden, intermediate=inter, tokens=tokens,
                triton_us=time_us(fused_experts_triton, (x, w13, w2, tw, ti)),
                torch_us=time_us(fused_experts_torch, (x, w13, w2, tw, ti)),
                max_abs_diff=float((triton_out.float() - torch_out.float()).abs().max()),
            )  # fmt: skip
            records.append(record)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    print(f"{'shape':16} {'tokens':>6} {'triton us':>10} {'torch us':>10} {'speedup':>8} {'max diff':>9}")
    for r in records:
        print(
            f"{r['shape']:16} {r['tokens']:6d} {r['triton_us']:10.1f} {r['torch_us']:10.1f} "
            f"{r['torch_us'] / r['triton_us']:8.2f} {r['max_abs_diff']:9.2e}"
        )


if __name__ == "__main__":
    main()
