"""The fused sampler's kernels alone on Qwen3's vocabulary: microseconds per call by batch size.

    PYTHONPATH=. python3 benchmarks/h200/gumbel_bench.py [--baseline OLD_GUMBEL_PY]

bf16 logits [B, 151936], temperature 0.6 on every row (nano-vllm's), timed with triton.testing.do_bench;
GB/s counts the logits read once. `--baseline` also times the gumbel_sample of another copy of
kvllm/sample/gumbel.py (say, `git show HEAD~1:kvllm/sample/gumbel.py`), alternating with the current one,
and checks that both give argmax ids on greedy rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import torch
import triton

from kvllm.sample.gumbel import gumbel_sample

VOCAB = 151936


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("gumbel_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gumbel_sample


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", help="another gumbel.py to time beside the current one")
    args = parser.parse_args()
    kernels = {"current": gumbel_sample}
    if args.baseline:
        kernels = {"baseline": load_baseline(args.baseline), "current": gumbel_sample}
    for batch in (1, 64, 256):
        logits = torch.randn(batch, VOCAB, device="cuda", dtype=torch.bfloat16)
        temperature = torch.full((batch,), 0.6, device="cuda")
        greedy = [fn(logits, None, None, seed=7, all_greedy=True) for fn in kernels.values()]
        if any(not torch.equal(g, logits.float().argmax(-1)) for g in greedy):
            print(json.dumps({"bench": "gumbel", "batch": batch, "error": "greedy ids differ from argmax"}))
        for round_ in range(2):  # alternating: the GPU's clock drifts over a call
            for name, fn in kernels.items():
                us = triton.testing.do_bench(
                    lambda f=fn, x=logits, t=temperature: f(x, t, None, seed=7), rep=200
                )
                us *= 1e3
                gbps = logits.numel() * logits.element_size() / (us * 1e-6) / 1e9
                print(json.dumps({"bench": "gumbel", "kernel": name, "round": round_, "batch": batch,
                                  "us": round(us, 2), "gb_per_s": round(gbps, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
