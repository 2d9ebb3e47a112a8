"""LLM.beam_search against a plain brute-force beam search over HF transformers' logits (same rules:
2 * beam_width candidates per beam, EOS beams set aside, score = cum logprob / len**length_penalty)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvllm import LLM, BeamSearchParams
from kvllm.beam_search import BeamSearchOutput

LOGPROB_ATOL = 1e-4


def _score(tokens: list[int], cum: float, eos: int, length_penalty: float) -> float:
    length = len(tokens) - (1 if tokens[-1] == eos else 0)
    return cum / length**length_penalty


def _hf_beam_search(
    model, prompt: list[int], params: BeamSearchParams, eos: int
) -> list[tuple[list[int], float]]:
    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(params.max_tokens):
        if not beams:
            break
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            top = torch.topk(logprobs, 2 * params.beam_width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                grown = (tokens + [token], cum + logprob)
                (completed if token == eos and not params.ignore_eos else candidates).append(grown)
        candidates.sort(key=lambda b: _score(*b, eos, params.length_penalty), reverse=True)
        beams = candidates[: params.beam_width]
    ranked = sorted(completed + beams, key=lambda b: _score(*b, eos, params.length_penalty), reverse=True)
    return ranked[: params.beam_width]


@pytest.fixture(scope="module")
def llm(tiny_llama_path: Path) -> LLM:
    return LLM(str(tiny_llama_path), dtype="float32", max_model_len=64)


@pytest.mark.parametrize(
    "params",
    [
        BeamSearchParams(beam_width=3, max_tokens=6),
        BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True, length_penalty=0.5),
        BeamSearchParams(beam_width=4, max_tokens=5, length_penalty=2.0, temperature=0.7),
    ],
    ids=["eos", "ignore_eos", "length_penalty"],
)
def test_beam_search_matches_brute_force_hf(
    llm: LLM, tiny_llama_path: Path, params: BeamSearchParams
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    # The text prompt is longer than a KV block, so the beams share cached blocks.
    prompts = [
        "Once upon a time, there was a little girl named Emma who lived in a small village",
        {"prompt_token_ids": [5, 17, 99, 3]},
    ]
    outputs = llm.beam_search(prompts, params)
    assert len(outputs) == 2 and all(isinstance(o, BeamSearchOutput) for o in outputs)
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt["prompt_token_ids"]
        expected = _hf_beam_search(hf, ids, params, tokenizer.eos_token_id)
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
        assert [s.cum_logprob for s in output.sequences] == pytest.approx(
            [c for _, c in expected], abs=LOGPROB_ATOL
        )
        for sequence in output.sequences:
            assert sequence.text == tokenizer.decode(sequence.tokens)
            assert len(sequence.logprobs) == len(sequence.tokens) - len(ids)
            assert sequence.finish_reason in ("stop", "length")
    reasons = [s.finish_reason for o in outputs for s in o.sequences]
    # The seeded model puts EOS among the candidates, so the completed-beam path runs (none with ignore_eos).
    assert ("stop" in reasons) is (not params.ignore_eos)
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.prefix_cache_hits > 0


def test_beam_search_params_are_checked() -> None:
    with pytest.raises(ValueError, match="beam_width=0"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
