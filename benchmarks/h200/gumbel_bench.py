"""The fused sampler's kernels alone on Qwen3's vocabulary: microseconds per call by batch size.

    PYTHONPATH=. python3 benchmarks/h200/gumbel_bench.py

bf16 logits [B, 151936], temperature 0.6 on every row (nano-vllm's), timed with triton.testing.do_bench;
GB/s counts the logits read once.
"""

from __future__ import annotations

import json

import torch
import triton

from kvllm.sample.gumbel import gumbel_sample

VOCAB = 151936


def main() -> None:
    for batch in (1, 64, 256):
        logits = torch.randn(batch, VOCAB, device="cuda", dtype=torch.bfloat16)
        temperature = torch.full((batch,), 0.6, device="cuda")
        us = (
            triton.testing.do_bench(
                lambda x=logits, t=temperature: gumbel_sample(x, t, None, seed=7), rep=200
            )
            * 1e3
        )
        gbps = logits.numel() * logits.element_size() / (us * 1e-6) / 1e9
        print(json.dumps({"bench": "gumbel", "batch": batch, "us": round(us, 2), "gb_per_s": round(gbps, 1)}))


if __name__ == "__main__":
    main()
