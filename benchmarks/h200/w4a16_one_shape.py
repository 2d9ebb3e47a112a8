"""The W4A16 GEMV (default config) and kvllm's bf16 GEMV on one Llama-3-8B projection at M = 1, a few calls
each, for a kernel profiler to attach to (issue 22):

    ncu --kernel-name regex:gemv --launch-skip 3 --launch-count 2 --set full \
        python3 benchmarks/h200/w4a16_one_shape.py --shape qkv
"""

from __future__ import annotations

import argparse

import torch

from kvllm.layers.ops.gemv import gemv
from kvllm.layers.quantization.ops.int4_layout import pack_kernel_layout
from kvllm.layers.quantization.ops.w4a16_gemv import W4A16GemvConfig, w4a16_gemv

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=SHAPES, default="qkv")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument(
        "--config", help="block_n,block_k,warps,stages,split_k,paired (default: the launcher's choice)"
    )
    args = parser.parse_args()
    n, k = SHAPES[args.shape]
    q = pack_kernel_layout(torch.randint(0, 16, (n, k), device="cuda"))
    s = (torch.rand(n, k // GROUP, device="cuda") * 0.003 + 0.001).bfloat16()
    z = torch.randint(0, 16, (n, k // GROUP), device="cuda").bfloat16()
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    config = None
    if args.config:
        bn, bk, warps, stages, split, paired = map(int, args.config.split(","))
        config = W4A16GemvConfig(bn, bk, warps, stages, split_k=split, paired=bool(paired))
    for _ in range(args.calls):
        w4a16_gemv(x, q, s, z, GROUP, config=config)
    for _ in range(args.calls):
        gemv(x, w)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
