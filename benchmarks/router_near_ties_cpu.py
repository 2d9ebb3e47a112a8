"""Where a tiny MoE model's expert choice is close enough to flip in bf16, on the CPU (no device call).

    PYTHONPATH=. .venv/bin/python benchmarks/router_near_ties_cpu.py [--model qwen3_moe] [--prompt 4]

Builds the tiny random-weight model of tests/gpu/test_models_gpu.py (tests/model_factory.py, heads of
128), takes that test's prompt number `--prompt` (seeded the same way) and HF float32's 16 greedy tokens
after it, then runs HF in float32 and bfloat16 over prompt + tokens and prints, per generated step and
router, the fp32 gap between the k-th and (k+1)-th expert logit at the step's position beside HF bf16's
largest error on that router's logits there, and the steps `router_near_ties` (tests/gpu/bf16_judge.py)
calls near-ties (gap <= 2 x error). This is the CPU side of the judge's MoE rule; on a GPU HF bf16's errors
differ, so the GPU test computes its own.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from tests import model_factory
from tests.gpu.bf16_judge import _router_gaps, hf_router_logits, router_near_ties
from tests.gpu.test_models_gpu import HEAD_DIM, MAX_NEW_TOKENS, PROMPT_LENGTHS
from tests.hf_reference import _hf_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_moe", choices=("qwen3_moe", "mixtral", "gpt_oss"))
    parser.add_argument(
        "--prompt", type=int, default=len(PROMPT_LENGTHS) - 1, help="index into PROMPT_LENGTHS"
    )
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp()) / args.model
    path = str(getattr(model_factory, f"make_tiny_{args.model}")(folder, head_dim=HEAD_DIM))
    rng = random.Random(len(args.model))  # as test_greedy_bf16_matches_hf_fp32 draws its prompts
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in PROMPT_LENGTHS]
    prompt = prompts[args.prompt]
    model = _hf_model(path, torch.float32, "cpu")
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(MAX_NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    tokens = ids[len(prompt) :]
    top_k, fp32 = hf_router_logits(path, prompt, tokens, torch.float32, "cpu")
    _, bf16 = hf_router_logits(path, prompt, tokens, torch.bfloat16, "cpu")
    ties = router_near_ties(top_k, fp32, bf16, len(prompt), len(tokens))
    print(f"{args.model}, prompt of {len(prompt)}, HF float32 greedy tokens {tokens}")
    print(f"{'step':>4} {'router':28} {'fp32 gap':>9} {'bf16 err':>9}  near-tie")
    for (name, a), (_, b) in zip(fp32, bf16, strict=True):
        gaps, errors = _router_gaps(a, top_k), (a - b).abs().amax(-1)
        for step in range(len(tokens)):
            position = len(prompt) - 1 + step
            gap, error = float(gaps[position]), float(errors[position])
            print(f"{step:>4} {name:28} {gap:9.4f} {error:9.4f}  {'yes' if gap <= 2 * error else ''}")
    print("near-ties by step:", {step: tie["router"] for step, tie in sorted(ties.items())})


if __name__ == "__main__":
    main()
