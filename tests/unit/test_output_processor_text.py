"""A sequence whose text is wanted only at its end (FINAL_ONLY, no stop strings) holds its ids and
detokenizes them in one call when it finishes: its text, finish reason and stop reason must be those of
the per-token path (CUMULATIVE outputs) for every way a sequence ends, with the real Qwen3 tokenizer
(byte-level BPE: multibyte characters span tokens)."""

from __future__ import annotations

import random

import pytest

from kvllm.core.request import Request
from kvllm.engine.output_processor import OutputProcessor
from kvllm.models.tokenizer import load_tokenizer
from kvllm.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer_dir):
    return load_tokenizer(str(qwen3_tokenizer_dir))


def _run(tokenizer, params: SamplingParams, prompt: list[int], tokens: list[int], eos: int) -> tuple:
    """Feed `tokens` one per step until the sequence finishes; (text, finish, stop reason, updates)."""
    processor = OutputProcessor(tokenizer, max_model_len=4096)
    request = Request("r", prompt, params, params.max_tokens, (eos,), parent_id="r")
    processor.add_request("r", None, prompt, [request])
    seq = processor.parents["r"].sequences[0]
    updates: list[int] = []  # the ids of each call that detokenizes (update, or finish_with at the end)
    detokenizer = seq.detokenizer
    update, finish_with = detokenizer.update, detokenizer.finish_with
    inside_finish = []

    def counted_update(ids, **kw):
        if not inside_finish:
            updates.append(len(ids))
        return update(ids, **kw)

    def counted_finish_with(ids, **kw):
        updates.append(len(ids))
        inside_finish.append(True)  # its fallback calls update: one detokenizing call all the same
        finish_with(ids, **kw)

    detokenizer.update, detokenizer.finish_with = counted_update, counted_finish_with
    for token in tokens:
        processor._append_token(seq, token, None, None)
        if request.finish_reason is not None:
            break
    return seq.text, request.finish_reason, request.stop_reason, updates


@pytest.mark.parametrize("seed", range(12))
def test_held_ids_give_the_per_token_text(tokenizer, seed) -> None:
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    stop_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    vocab = len(tokenizer)
    # Mostly ordinary ids, some multibyte-heavy high ids, an occasional EOS / stop token / special id.
    tokens = [rng.choice([rng.randrange(200, 20000), rng.randrange(100000, vocab), eos, stop_id, 151643])
              if rng.random() < 0.08 else rng.randrange(200, vocab - 300) for _ in range(60)]  # fmt: skip
    prompt = [rng.randrange(200, 20000) for _ in range(rng.randrange(0, 9))]
    common = dict(
        max_tokens=(max_tokens := rng.choice([5, 30, 60])),
        min_tokens=min(max_tokens, rng.choice([0, 0, 10])),
        ignore_eos=rng.random() < 0.3,
        stop_token_ids=[stop_id] if rng.random() < 0.5 else None,
        skip_special_tokens=rng.random() < 0.7,
        include_stop_str_in_output=rng.random() < 0.3,
    )
    per_token = _run(tokenizer, SamplingParams(**common, output_kind=RequestOutputKind.CUMULATIVE), prompt,
                     tokens, eos)  # fmt: skip
    held = _run(
        tokenizer, SamplingParams(**common, output_kind=RequestOutputKind.FINAL_ONLY), prompt, tokens, eos
    )
    assert held[:3] == per_token[:3]
    assert per_token[3] == [1] * len(per_token[3])  # one update per token
    assert held[3] == [len(per_token[3])]  # the held path: one update of all of them, at the end


def test_stop_strings_keep_the_per_token_path(tokenizer) -> None:
    """A stop string must be watched token by token, so a FINAL_ONLY request with one holds nothing."""
    ids = tokenizer.encode("one two three four five six")
    params = SamplingParams(max_tokens=50, stop=["four"], output_kind=RequestOutputKind.FINAL_ONLY)
    text, finish, stop_reason, updates = _run(tokenizer, params, [], ids, tokenizer.eos_token_id)
    assert (text, finish, stop_reason) == ("one two three ", "stop", "four")
    assert updates == [1] * len(updates)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("include_stop_str_in_output", [True, False])
@pytest.mark.parametrize("end", ["eos", "stop_token", "eos_before_min_tokens"])
def test_the_finishing_token_is_treated_as_per_token(
    tokenizer, skip_special_tokens, include_stop_str_in_output, end
) -> None:
    """EOS or a stop token ends the text (kept only with include_stop_str_in_output); before
    min_tokens an EOS is text like any token."""
    eos, stop_id = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = tokenizer.encode("héllo wörld, naïve café")
    last = stop_id if end == "stop_token" else eos
    tokens = ids + [last] + ids
    common = dict(
        max_tokens=len(tokens),
        min_tokens=len(ids) + 3 if end == "eos_before_min_tokens" else 0,
        stop_token_ids=[stop_id],
        skip_special_tokens=skip_special_tokens,
        include_stop_str_in_output=include_stop_str_in_output,
    )
    per_token = _run(
        tokenizer, SamplingParams(**common, output_kind=RequestOutputKind.CUMULATIVE), [], tokens, eos
    )
    held = _run(
        tokenizer, SamplingParams(**common, output_kind=RequestOutputKind.FINAL_ONLY), [], tokens, eos
    )
    assert held[:3] == per_token[:3]
    assert per_token[1] == ("length" if end == "eos_before_min_tokens" else "stop")
    assert len(held[3]) == 1


def test_a_held_sequence_finishes_in_one_decode_not_a_stream_step_per_id(tokenizer) -> None:
    """The held ids of a sequence that ends are decoded in one call (the stream is stepped for none of
    them), and the text is the per-token path's."""
    ids = tokenizer.encode("héllo wörld, naïve café: 東京タワー ✓ " * 4)
    params = SamplingParams(max_tokens=len(ids), output_kind=RequestOutputKind.FINAL_ONLY)
    processor = OutputProcessor(tokenizer, max_model_len=4096)
    request = Request("r", [11, 12], params, params.max_tokens, (tokenizer.eos_token_id,), parent_id="r")
    processor.add_request("r", None, [11, 12], [request])
    seq = processor.parents["r"].sequences[0]
    assert seq.detokenizer._stream is not None  # the Qwen3 tokenizer is a Rust one: the stream path
    steps = []
    stream, rust = seq.detokenizer._stream, seq.detokenizer._rust

    class CountingStream:
        def step(self, tokenizer, token_id):
            steps.append(token_id)
            return stream.step(tokenizer, token_id)

    seq.detokenizer._stream = CountingStream()
    for token in ids:
        processor._append_token(seq, token, None, None)
    assert request.finish_reason == "length"
    assert steps == []
    per_token = _run(
        tokenizer, SamplingParams(max_tokens=len(ids), output_kind=RequestOutputKind.CUMULATIVE), [11, 12], ids,
        tokenizer.eos_token_id,
    )  # fmt: skip
    assert seq.text == per_token[0] == rust.decode(ids)
