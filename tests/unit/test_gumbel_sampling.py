"""The fused one-pass sampler (Triton, run by the interpreter here) against the distribution it must
draw from, and the Sampler's choice between it and the torch path."""

from __future__ import annotations

import pytest
import torch

from kvllm.sample.gumbel import BLOCK_V, gumbel_sample
from kvllm.sample.sampler import Sampler, SamplingRow
from kvllm.sampling_params import SamplingParams


def test_greedy_rows_are_argmax_with_first_index_on_ties():
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(0))
    logits[2, 7] = logits[2, 2500] = 50.0  # a tie across blocks: the first index wins, as torch.argmax
    out = gumbel_sample(logits, None, None, seed=1, all_greedy=True)
    assert out.tolist() == logits.argmax(-1).tolist() and out[2] == 7


def test_frequencies_match_softmax_of_logits_over_temperature():
    vocab, rows = 6, 1500  # the interpreter runs one program (row) at a time
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    temperature = 0.7
    logits = base.expand(rows, vocab).contiguous().to(torch.float16)
    temps = torch.full((rows,), temperature)
    out = gumbel_sample(logits, temps, None, seed=1234)
    counts = torch.bincount(out, minlength=vocab).double()
    expected = (logits[0].float() / temperature).double().softmax(-1) * rows
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 30.0, (chi2, counts, expected)  # df = 5: p(chi2 > 30) ~ 1.5e-5
    # Another seed, other draws; the same seed, the same draws.
    assert not torch.equal(gumbel_sample(logits[:64], temps[:64], None, seed=99), out[:64])
    assert torch.equal(gumbel_sample(logits[:64], temps[:64], None, seed=1234), out[:64])


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(5))
    is_greedy = torch.tensor([True, False, True, False, False, True])
    out = gumbel_sample(logits, torch.full((6,), 5.0), is_greedy, seed=7)
    greedy_rows = is_greedy.nonzero().squeeze(1)
    assert out[greedy_rows].tolist() == logits[greedy_rows].argmax(-1).tolist()
    # At temperature 5 the random rows spread out: not all of them land on their argmax.
    draws = torch.stack([gumbel_sample(logits, torch.full((6,), 5.0), is_greedy, seed=s) for s in range(20)])
    assert (draws[:, ~is_greedy] != logits[~is_greedy].argmax(-1)).any()


def test_draws_do_not_depend_on_the_chunking():
    vocab = 7 * BLOCK_V + 1000  # 8 blocks, the last one partial: 1, 3 and 8 chunks all fit
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(8)).to(torch.float16)
    temps = torch.tensor([1.0, 0.5, 2.0, 1.0])
    is_greedy = torch.tensor([False, False, False, True])
    draws = [gumbel_sample(logits, temps, is_greedy, seed=11, num_chunks=c) for c in (1, 3, 8, None)]
    assert all(torch.equal(d, draws[0]) for d in draws[1:]), draws
    assert draws[0][3] == logits[3].argmax()
    assert not torch.equal(gumbel_sample(logits, temps, is_greedy, seed=12, num_chunks=3), draws[0])


@pytest.mark.parametrize("num_chunks", [1, 2, 5, None])
def test_greedy_ties_across_chunks_pick_the_first_index(num_chunks):
    vocab = 4 * BLOCK_V + 77
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4))
    logits[0, BLOCK_V - 1] = logits[0, BLOCK_V] = 50.0  # either side of a chunk boundary
    logits[1, 3 * BLOCK_V + 5] = logits[1, vocab - 1] = logits[1, 2 * BLOCK_V + 9] = 50.0
    logits[2] = 0.0  # every id ties
    out = gumbel_sample(logits, None, None, seed=0, all_greedy=True, num_chunks=num_chunks)
    assert out.tolist() == [BLOCK_V - 1, 2 * BLOCK_V + 9, 0] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("num_chunks", [1, 4, None])
def test_rows_with_one_finite_logit_draw_it(num_chunks):
    vocab = 3 * BLOCK_V + 10
    targets = [0, BLOCK_V, vocab - 1, 2 * BLOCK_V - 1]
    logits = torch.full((5, vocab), float("-inf"), dtype=torch.bfloat16)
    for row, token in enumerate(targets):
        logits[row, token] = -3.0
    is_greedy = torch.tensor([False, True, False, False, False])
    for seed in range(3):
        out = gumbel_sample(logits, torch.full((5,), 0.7), is_greedy, seed=seed, num_chunks=num_chunks)
        # The last row has no finite logit at all: id 0, as torch.argmax.
        assert out.dtype == torch.int64 and out.tolist() == targets + [0]


def test_sampler_uses_the_fused_pass_only_where_it_applies(monkeypatch):
    import kvllm.sample.gumbel as gumbel

    calls = []
    real = gumbel.gumbel_sample
    monkeypatch.setattr(gumbel, "gumbel_sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    sampler = Sampler(fused=True)
    rows = [SamplingRow(SamplingParams(temperature=0.8), [], []) for _ in range(3)]
    out = sampler(logits, rows)
    assert len(calls) == 1 and len(out.token_ids) == 3
    # Truncation or a seeded generator: the torch path.
    sampler(logits, [SamplingRow(SamplingParams(top_k=5), [], []) for _ in range(3)])
    generator = torch.Generator().manual_seed(0)
    sampler(logits, [SamplingRow(SamplingParams(seed=1), [], [], generator) for _ in range(3)])
    assert len(calls) == 1
    # Penalties still apply before the fused pass (in float32).
    penalised = [
        SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=50.0), [int(logits[0].argmax())], [])
    ]
    token = sampler(logits[:1], penalised).token_ids[0]
    assert len(calls) == 2 and token != int(logits[0].argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rejects_bad_layouts(dtype):
    with pytest.raises(ValueError, match="contiguous"):
        gumbel_sample(torch.randn(64, 4, dtype=dtype).t(), None, None, seed=0)
    with pytest.raises(ValueError, match="empty vocabulary"):
        gumbel_sample(torch.randn(3, 0, dtype=dtype), None, None, seed=0)


def _random_bitmask(rows: int, words: int, generator: torch.Generator) -> torch.Tensor:
    bits = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=generator)
    bits[0] = -1  # an unconstrained row: every bit set
    bits[1] = 0
    bits[1, 5] = 1 << 9  # one allowed token: 5 * 32 + 9
    return bits


@pytest.mark.parametrize("num_chunks", [1, 3, None])
def test_a_bitmask_draws_as_the_logits_masked_first(num_chunks):
    """The grammar's bitmask read inside the pass gives the ids of masking the logits to -inf first (the
    noise is keyed by token id), forbidden tokens and those past the mask's words are never drawn."""
    from kvllm.sample.structured import GrammarBitmaskInputs, apply_grammar_bitmask, unpack_bitmask

    g = torch.Generator().manual_seed(21)
    vocab = 2 * BLOCK_V + 300
    words = vocab // 32 - 3  # narrower than the vocabulary: its last 108 tokens are forbidden
    logits = (torch.randn(5, vocab, generator=g) * 4).to(torch.float16)
    bitmask = _random_bitmask(5, words, g)
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0])
    is_greedy = torch.tensor([False, False, False, True, False])
    masked = apply_grammar_bitmask(logits, GrammarBitmaskInputs(bitmask))
    allowed = unpack_bitmask(bitmask, vocab)
    for seed in (3, 4, 5):
        got = gumbel_sample(logits, temps, is_greedy, seed=seed, num_chunks=num_chunks, bitmask=bitmask)
        want = gumbel_sample(masked, temps, is_greedy, seed=seed, num_chunks=num_chunks)
        assert torch.equal(got, want), (got, want)
        assert all(allowed[r, t] for r, t in enumerate(got.tolist()))
        assert got[1] == 5 * 32 + 9
    with pytest.raises(ValueError, match="bitmask must be int32"):
        gumbel_sample(logits, None, None, seed=0, bitmask=bitmask.long())


def test_sampler_leaves_the_mask_to_the_fused_pass_unless_logprobs_need_it(monkeypatch):
    import kvllm.sample.sampler as sampler_module
    from kvllm.sample.metadata import SamplingMetadata
    from kvllm.sample.structured import GrammarBitmaskInputs, unpack_bitmask

    calls = []
    real = sampler_module.apply_grammar_bitmask
    monkeypatch.setattr(sampler_module, "apply_grammar_bitmask", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(22)
    logits = torch.randn(4, 200, generator=g)
    bitmask = _random_bitmask(4, 6, g)  # 192 tokens: the last 8 are forbidden
    allowed = unpack_bitmask(bitmask, 200)
    for logprobs, applied in ((None, 0), (0, 1)):
        calls.clear()
        md = SamplingMetadata.from_params(
            [SamplingParams(temperature=1.0, logprobs=logprobs)] * 4, logits.device, 200
        )
        md.grammar = GrammarBitmaskInputs(bitmask)
        token_ids = Sampler(fused=True).sample(logits, md).token_ids.tolist()
        assert len(calls) == applied
        assert all(allowed[r, t] for r, t in enumerate(token_ids))
