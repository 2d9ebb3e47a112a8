"""On a CUDA GPU: the fused one-pass sampler on bf16 logits draws from softmax(logits / T), and the
Sampler's device path (fused pass, greedy rows, logprobs) agrees with its list-based interface."""

from __future__ import annotations

import pytest
import torch

from kvllm.sample.gumbel import gumbel_sample
from kvllm.sample.sampler import Sampler, SamplingRow
from kvllm.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_bf16_frequencies_match_the_distribution():
    vocab, rows = 50, 200_000
    base = (torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 2).to(torch.bfloat16)
    logits = base.cuda().expand(rows, vocab).contiguous()
    temperature = torch.full((rows,), 0.6, device="cuda")
    out = gumbel_sample(logits, temperature, None, seed=42)
    counts = torch.bincount(out, minlength=vocab).double().cpu()
    expected = (base.float() / 0.6).double().softmax(-1) * rows
    keep = expected > 5  # chi-square over the cells with enough mass
    chi2 = (((counts - expected) ** 2 / expected)[keep]).sum().item()
    assert chi2 < int(keep.sum()) + 6 * int(keep.sum()) ** 0.5 + 20, (chi2, int(keep.sum()))
    assert counts[expected < 1e-9].sum() == 0


def test_large_vocab_greedy_equals_argmax():
    logits = torch.randn(256, 151936, device="cuda", dtype=torch.bfloat16)
    out = gumbel_sample(logits, None, None, seed=0, all_greedy=True)
    assert torch.equal(out, logits.float().argmax(-1))


def test_device_path_matches_rows_interface_for_greedy_with_logprobs():
    logits = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=3), [], []) for _ in range(8)]
    out = Sampler()(logits, rows)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert all(len(lp) >= 3 for lp in out.logprobs)
