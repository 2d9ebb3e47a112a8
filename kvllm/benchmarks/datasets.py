"""Benchmark workloads: random token-id prompts, and nano-vllm's bench.py workload reproduced exactly."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Random prompt ids are drawn below this bound (vLLM and nano-vllm both use 10,000), which every
# real model vocabulary exceeds; tiny test models get their vocabulary size instead.
RANDOM_TOKEN_BOUND = 10000
NANO_VLLM_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: prompt ids and how many tokens to generate (EOS ignored)."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 0,
    range_ratio: float = 0.0,
) -> list[BenchRequest]:
    """`num_prompts` prompts of random ids; lengths uniform in [len*(1-r), len*(1+r)] (vLLM's random set)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio={range_ratio} is not valid; allowed: 0 <= ratio < 1")
    if input_len < 1 or output_len < 1 or num_prompts < 1:
        raise ValueError(
            f"input_len={input_len}, output_len={output_len}, num_prompts={num_prompts}: each must be >= 1"
        )
    rng = random.Random(seed)
    bound = min(RANDOM_TOKEN_BOUND, vocab_size)

    def length(n: int) -> int:
        low, high = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.randint(low, high)

    requests = []
    for _ in range(num_prompts):
        prompt_len, out_len = length(input_len), length(output_len)
        requests.append(BenchRequest([rng.randrange(bound) for _ in range(prompt_len)], out_len))
    return requests


def nano_vllm_requests(vocab_size: int | None = None) -> list[BenchRequest]:
    """nano-vllm's bench.py: 256 sequences, input and output lengths uniform in [100, 1024], ids in
    [0, 10000], Python's `random` seeded with 0, drawn in the same order as bench.py so the prompts
    are identical."""
    rng = random.Random(0)
    num_seqs, max_input_len, max_output_len = 256, 1024, 1024
    prompts = [
        [rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))] for _ in range(num_seqs)
    ]
    output_lens = [rng.randint(100, max_output_len) for _ in range(num_seqs)]
    if vocab_size is not None and vocab_size <= 10000:
        raise ValueError(
            f"the nano-vllm workload draws ids up to 10000; this model's vocabulary is {vocab_size}"
        )
    return [BenchRequest(p, n) for p, n in zip(prompts, output_lens)]
