"""The bf16 judge of the GPU tests (tests/gpu/bf16_judge.py) on synthetic logits: it passes bf16-sized
noise, and fails errors beyond HF bf16's own, flips that are no near-tie, and a greedy pick that is not the
engine's own top token."""

from __future__ import annotations

import json

import pytest
import torch

from tests.gpu.bf16_judge import ERROR_FLOOR, judge, router_near_ties

STEPS, VOCAB, TOP_K = 12, 64, 4


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(STEPS, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _noise(seed: int, scale: float) -> torch.Tensor:
    return torch.randn(STEPS, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _engine(logits: torch.Tensor) -> tuple[list[int], list[dict[int, float]]]:
    """Greedy tokens and what a logprobs=TOP_K run returns per step: the chosen token plus the top k."""
    logprobs = torch.log_softmax(logits, -1)
    tokens = logprobs.argmax(-1).tolist()
    top = logprobs.topk(TOP_K, -1)
    entries = [
        {t: float(logprobs[s, t]), **dict(zip(top.indices[s].tolist(), top.values[s].tolist()))}
        for s, t in enumerate(tokens)
    ]
    return tokens, entries


def _run(logits, engine_logits, hf_bf16_logits):
    tokens, entries = _engine(engine_logits)
    return judge(5, tokens, entries, torch.log_softmax(logits, -1), torch.log_softmax(hf_bf16_logits, -1))


def test_bf16_sized_noise_passes_and_is_reported() -> None:
    logits = _logits(0)
    result = _run(logits, logits + _noise(1, 0.03), logits + _noise(2, 0.03))
    assert result.ok, result.failures
    assert 0 < result.engine_error < 0.2 and 0 < result.hf_bf16_error < 0.2
    assert result.allowed_error == max(3 * result.hf_bf16_error, ERROR_FLOOR)
    assert len(result.engine_error_per_step) == STEPS
    report = json.loads(json.dumps(result.to_dict()))
    assert report["ok"] and report["engine_error"] == result.engine_error


def test_an_error_beyond_three_times_hf_bf16s_fails() -> None:
    logits = _logits(3)
    wrong = logits.clone()
    wrong[7] += _noise(4, 0.5)[7]  # one step off by a feature-sized amount, the rest exact
    result = _run(logits, wrong, logits + _noise(5, 0.02))
    assert not result.ok
    assert any("logprob error" in f and "(step 7)" in f for f in result.failures), result.failures


def test_the_floor_admits_tiny_errors_when_hf_bf16_is_exact() -> None:
    logits = _logits(6)
    within = _run(logits, logits + _noise(7, 0.004), logits)
    assert within.hf_bf16_error == 0 and within.ok, within.failures
    beyond = _run(logits, logits + _noise(7, 0.04), logits)
    assert beyond.engine_error > ERROR_FLOOR and not beyond.ok


def _near_tie(seed: int, gap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits whose step 4 has two leaders `gap` apart in fp32, and engine logits that swap them."""
    logits = _logits(seed)
    a, b = logits[4].topk(2).indices.tolist()
    logits[4, b] = logits[4, a] - gap
    engine = logits + _noise(seed + 1, 0.03)
    engine[4, a], engine[4, b] = logits[4, a] - gap / 2, logits[4, a] + gap / 2
    return logits, engine


def test_a_flip_at_a_near_tie_is_recorded_and_later_steps_still_judged() -> None:
    logits, engine = _near_tie(8, gap=0.02)
    result = _run(logits, engine, logits + _noise(10, 0.03))
    assert result.ok, result.failures
    assert [(f.step, f.near_tie) for f in result.flips] == [(4, True)]
    assert result.flips[0].fp32_gap == pytest.approx(0.02, abs=1e-4)
    # Past the flip the judge keeps comparing: a wrong later step still fails.
    engine[9, int(logits[9].argmin())] = engine[9].max() + 5
    later = _run(logits, engine, logits + _noise(10, 0.03))
    assert [f.step for f in later.flips] == [4, 9] and not later.ok


def test_a_flip_beyond_both_bf16_errors_fails() -> None:
    logits, engine = _near_tie(11, gap=0.5)
    result = _run(logits, engine, logits + _noise(13, 0.03))
    assert [f.step for f in result.flips] == [4] and not result.flips[0].near_tie
    assert any("not a near-tie" in f for f in result.failures), result.failures


def test_an_exact_fp32_tie_broken_the_other_way_is_a_near_tie() -> None:
    logits = _logits(16)
    a, b = logits[3].topk(2).indices.tolist()
    logits[3, b] = logits[3, a]
    fp32 = torch.log_softmax(logits, -1)
    tokens, entries = _engine(logits)
    tokens[3] = a if tokens[3] == b else b  # the tie's other token, with exactly fp32's logprobs
    entries[3][tokens[3]] = float(fp32[3, tokens[3]])
    result = judge(5, tokens, entries, fp32, fp32)
    assert result.tie_bound == 0 and result.ok, result.failures
    assert [(f.step, f.fp32_gap, f.near_tie) for f in result.flips] == [(3, 0.0, True)]


def test_router_near_ties_are_the_steps_whose_expert_choice_bf16_can_flip() -> None:
    """A position whose fp32 k-th / (k+1)-th router gap is within 2 x HF bf16's router error there is a
    near-tie of the step it feeds; a wider gap, or a tie inside the prompt, is not."""
    prompt_len, steps, experts, top_k = 6, 5, 8, 2
    gen = torch.Generator().manual_seed(20)
    fp32 = torch.randn(prompt_len + steps - 1, experts, generator=gen) * 2
    bf16 = fp32 + torch.randn(fp32.shape, generator=gen) * 0.001

    def set_gap(position: int, gap: float) -> None:
        order = fp32[position].argsort(descending=True)
        fp32[position, order[top_k]] = fp32[position, order[top_k - 1]] - gap

    set_gap(prompt_len - 1 + 3, 0.01)  # step 3: the gap is a few bf16 errors wide ...
    bf16[prompt_len - 1 + 3] = fp32[prompt_len - 1 + 3] + 0.02  # ... of 0.02: a near-tie
    set_gap(prompt_len - 1 + 1, 0.5)  # step 1: far wider than its 0.02 error
    bf16[prompt_len - 1 + 1] = fp32[prompt_len - 1 + 1] + 0.02
    set_gap(2, 0.0)  # an exact tie inside the prompt feeds no generated step
    ties = router_near_ties(top_k, [("layer.mlp.gate", fp32)], [("layer.mlp.gate", bf16)], prompt_len, steps)
    assert sorted(ties) == [3], ties
    assert ties[3]["margin"] == pytest.approx(0.01, abs=1e-5) and ties[3]["bf16_error"] == pytest.approx(0.02)
    assert ties[3]["router"] == "layer.mlp.gate" and ties[3]["position"] == prompt_len - 1 + 3


def test_a_router_near_tie_excuses_its_own_step_only() -> None:
    logits = _logits(21)
    wrong = logits.clone()
    wrong[7] += _noise(22, 0.5)[7]  # as an expert flip would move one step
    tie = {"router": "model.layers.2.mlp.gate", "position": 11, "margin": 0.05, "bf16_error": 0.04}
    tokens, entries = _engine(wrong)
    fp32, bf16 = torch.log_softmax(logits, -1), torch.log_softmax(logits + _noise(23, 0.02), -1)
    excused = judge(5, tokens, entries, fp32, bf16, router_ties={7: tie})
    assert excused.ok, excused.failures
    assert {e["step"] for e in excused.router_excused} == {7} and excused.engine_error > excused.allowed_error
    elsewhere = judge(5, tokens, entries, fp32, bf16, router_ties={6: tie})
    assert not elsewhere.ok and elsewhere.router_excused == []
    assert any("(step 7)" in f for f in elsewhere.failures), elsewhere.failures
    wrong[2] += _noise(24, 0.5)[2]  # a second step off, with no tie behind it, still fails
    tokens, entries = _engine(wrong)
    both = judge(5, tokens, entries, fp32, bf16, router_ties={7: tie})
    assert not both.ok and any("(step 2)" in f and "router near-ties" in f for f in both.failures)


def test_a_greedy_token_that_is_not_the_engines_own_top_fails() -> None:
    logits = _logits(14)
    tokens, entries = _engine(logits)
    second = sorted(entries[2], key=entries[2].get)[-2]
    tokens[2] = second
    fp32 = torch.log_softmax(logits, -1)
    result = judge(5, tokens, entries, fp32, fp32)
    assert any("step 2: greedy token" in f for f in result.failures), result.failures


def test_malformed_inputs_are_refused() -> None:
    logits = _logits(15)
    tokens, entries = _engine(logits)
    fp32 = torch.log_softmax(logits, -1)
    with pytest.raises(ValueError, match="one row per generated token"):
        judge(5, tokens, entries, fp32[:-1], fp32[:-1])
    entries[0] = {k: v for k, v in entries[0].items() if k != tokens[0]}
    with pytest.raises(ValueError, match="lack its token"):
        judge(5, tokens, entries, fp32, fp32)


def test_the_engines_bf16_cpu_run_passes_the_judge(tmp_path) -> None:
    """The judge on a real engine run (kvllm Logprob entries, HF run by judge_against_hf): gpt-oss in bf16
    on CPU_ATTN, with sinks, a window and MoE routing that bf16 can flip (its router margins recorded)."""
    import random

    from kvllm import LLM, SamplingParams
    from tests import model_factory
    from tests.gpu.bf16_judge import TOP_LOGPROBS, failure_summary, judge_against_hf

    path = str(model_factory.make_tiny_gpt_oss(tmp_path))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (1, 30)]
    llm = LLM(
        path,
        dtype="bfloat16",
        attention_backend="CPU_ATTN",
        kv_cache_memory_bytes=2**24,
        max_model_len=64,
        max_num_seqs=2,
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=TOP_LOGPROBS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    judged = [
        judge_against_hf(path, p, o.outputs[0].token_ids, o.outputs[0].logprobs, "cpu")
        for p, o in zip(prompts, outs)
    ]
    assert all(j.ok for j in judged), failure_summary(judged)
    assert all(j.steps == 8 and j.hf_bf16_error > 0 for j in judged)
    for j, prompt in zip(judged, prompts):  # the routing diagnosis: smallest fp32 router gaps first
        margins = j.fp32_router_margins
        assert len(margins) == 5 and [m["margin"] for m in margins] == sorted(m["margin"] for m in margins)
        assert all(
            m["router"].endswith(".mlp.router") and 0 <= m["position"] < len(prompt) + 7 for m in margins
        )
