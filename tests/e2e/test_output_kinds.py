"""RequestOutputKind: cumulative, delta and final-only outputs agree, and a step's host work on the
output side does not grow with how long a request has run (counted work, not time)."""

from __future__ import annotations

import pytest

from kvllm import LLM, SamplingParams
from kvllm.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def llm(tiny_qwen3_path):
    return LLM(str(tiny_qwen3_path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 22)


def _run(engine, kind: RequestOutputKind, n: int = 1, stop: list[str] | None = None):
    params = SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1, n=n, output_kind=kind, stop=stop or []
    )
    engine.add_request("r", "Once upon a time, there was", params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o for o in engine.step() if o.request_id == "r"]
    return seen


@pytest.mark.parametrize("n", [1, 2])
def test_delta_outputs_add_up_to_the_cumulative_result(llm, n):
    engine = llm.llm_engine
    cumulative = _run(engine, RequestOutputKind.CUMULATIVE, n)
    deltas = _run(engine, RequestOutputKind.DELTA, n)
    final = _run(engine, RequestOutputKind.FINAL_ONLY, n)
    assert len(final) == 1 and final[0].finished and len(deltas) > 1
    for i in range(n):
        whole = cumulative[-1].outputs[i]
        pieces = [o.outputs[i] for o in deltas]
        assert "".join(p.text for p in pieces) == whole.text == final[0].outputs[i].text
        assert [t for p in pieces for t in p.token_ids] == whole.token_ids == final[0].outputs[i].token_ids
        assert [lp for p in pieces for lp in p.logprobs] == whole.logprobs
        assert pieces[-1].finish_reason == whole.finish_reason == "length"


def test_delta_text_never_shows_a_stop_string(llm):
    engine = llm.llm_engine
    reference = _run(engine, RequestOutputKind.FINAL_ONLY)[0].outputs[0].text
    stop = reference[10:14]
    deltas = _run(engine, RequestOutputKind.DELTA, stop=[stop])
    text = "".join(o.outputs[0].text for o in deltas)
    assert stop not in text and reference.startswith(text) and deltas[-1].outputs[0].finish_reason == "stop"


def test_final_only_builds_one_output_per_request(llm, monkeypatch):
    """FINAL_ONLY (what LLM.generate uses): nothing proportional to a request's length is copied
    per step; each request's output is built once, when it finishes."""
    import kvllm.engine.output_processor as output_processor

    engine = llm.llm_engine
    built: list[int] = []
    real_output = output_processor.CompletionOutput

    def counting_output(*args, **kwargs):
        out = real_output(*args, **kwargs)
        built.append(len(out.token_ids))
        return out

    monkeypatch.setattr(output_processor, "CompletionOutput", counting_output)
    params = SamplingParams(
        temperature=0.0, max_tokens=120, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    for i in range(3):
        engine.add_request(f"w{i}", "Once upon a time, there was", params)
    while engine.has_unfinished_requests():
        engine.step()
    assert built == [120, 120, 120]


def test_detokenizing_a_long_output_costs_the_same_per_token(llm):
    """On ordinary text the incremental detokenizer decodes a bounded window per token, however
    long the output already is."""
    from kvllm.engine.detokenizer import IncrementalDetokenizer

    tokenizer = llm.get_tokenizer()
    ids = tokenizer("The quick brown fox jumps over the lazy dog while the cat sleeps. " * 40).input_ids
    decoded: list[int] = []
    real_decode = tokenizer.decode
    tokenizer.decode = lambda ids, **kw: decoded.append(len(ids)) or real_decode(ids, **kw)
    try:
        detok = IncrementalDetokenizer(tokenizer, ids[:5], SamplingParams())
        per_token = []
        for token in ids:
            before = sum(decoded)
            detok.update([token])
            per_token.append(sum(decoded) - before)
    finally:
        del tokenizer.decode
    assert detok.output_text == real_decode(ids)
    assert max(per_token[-100:]) <= max(per_token[:100]), per_token
