"""IncrementalDetokenizer on a small byte-level BPE tokenizer trained in the test."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvllm.engine.detokenizer import IncrementalDetokenizer
from kvllm.sampling_params import SamplingParams

CORPUS = ["hello world, the stop sign. héllo wörld 世界 naïve café ", "The end is near. END end STOP."]
TEXT = "héllo wörld 🙂 世界 naïve 🚀 café, the end."


@pytest.fixture(scope="module")
def raw_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer(raw_tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=raw_tokenizer, eos_token="<|im_end|>")


def _decode(tokenizer, ids, skip_special_tokens=True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    """Feed ids one at a time; return the streamed deltas (after finish) and the matched stop."""
    deltas, stop = [], None
    for token_id in ids:
        stop = detok.update([token_id])
        deltas.append(detok.get_next_delta_text())
        if stop is not None:
            break
    detok.finish()
    deltas.append(detok.get_next_delta_text())
    assert detok.get_next_delta_text() == ""
    return deltas, stop


def test_multibyte_characters_are_never_emitted_half_done(tokenizer):
    ids = tokenizer.encode(TEXT)
    single = [_decode(tokenizer, [t]) for t in ids]
    assert any("\ufffd" in s for s in single), "the test text must split characters across tokens"
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt: "), SamplingParams())
    snapshots = []
    for t in ids:
        assert detok.update([t]) is None
        snapshots.append(detok.output_text)
    assert detok.output_text == TEXT
    for snapshot in snapshots:
        assert "\ufffd" not in snapshot and TEXT.startswith(snapshot)


def test_random_tokens_decode_like_the_tokenizer(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    for trial in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        prompt = [rng.randrange(vocab) for _ in range(3)]
        detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
        previous = ""
        step = 0
        while step < len(ids):
            chunk = ids[step : step + 1 + trial % 3]  # several tokens per update too
            detok.update(chunk)
            step += len(chunk)
            assert detok.output_text.startswith(previous)
            previous = detok.output_text
        detok.finish()
        assert detok.output_text == _decode(tokenizer, ids)


class PythonOnly:
    """A tokenizer without a Rust backend (as a slow transformers tokenizer): the Python decode path."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.inner = tokenizer
        self.decoded_lengths: list[int] = []

    def __len__(self) -> int:
        return len(self.inner)

    def convert_ids_to_tokens(self, ids):
        return self.inner.convert_ids_to_tokens(ids)

    def decode(self, ids, **kwargs):
        self.decoded_lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def test_window_stays_small(tokenizer):
    """Each step of the Python path decodes a few ids, not the whole sequence."""
    python_only = PythonOnly(tokenizer)
    ids = tokenizer.encode(TEXT * 20)
    detok = IncrementalDetokenizer(python_only, [], SamplingParams())
    assert detok._stream is None
    for t in ids:
        detok.update([t])
    assert detok.output_text == TEXT * 20
    assert max(python_only.decoded_lengths) <= 8


def test_decode_stream_and_python_paths_agree(tokenizer):
    """Fast tokenizers decode through the library's DecodeStream; both paths give the same text and
    deltas, including prompts that end mid-character (the stream path then hands over to Python)."""
    rng = random.Random(1)
    vocab = len(tokenizer)
    used_stream = fell_back = 0
    for trial in range(60):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 50))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]
        results = []
        for tok in (tokenizer, PythonOnly(tokenizer)):
            detok = IncrementalDetokenizer(
                tok, prompt, SamplingParams(stop=["he"] if trial % 4 == 0 else None)
            )
            deltas, step = [], 0
            while step < len(ids) and not detok.is_finished:
                chunk = ids[step : step + 1 + trial % 3]
                detok.update(chunk)
                deltas.append(detok.get_next_delta_text())
                step += len(chunk)
            detok.finish()
            deltas.append(detok.get_next_delta_text())
            results.append((detok.output_text, "".join(deltas), detok.stop_reason))
            if tok is tokenizer:
                used_stream += detok._stream is not None
                fell_back += detok._stream is None
        assert results[0] == results[1], (trial, results)
        if results[0][2] is None and not prompt:  # (random prompt bytes may combine with the output's)
            assert results[0][0] == _decode(tokenizer, ids)
    assert used_stream > 30 and fell_back > 0, (used_stream, fell_back)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_is_cut_exactly(tokenizer, include):
    ids = tokenizer.encode("hello STOP world")
    assert _decode(tokenizer, [ids[-3]]) != " STOP"  # "STOP" is spread over several tokens
    params = SamplingParams(stop=["STOP", "nothing"], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    matched_at = None
    for i, t in enumerate(ids):
        if detok.update([t]) is not None:
            matched_at = i
            break
    assert detok.stop_reason == "STOP" and detok.is_finished
    assert _decode(tokenizer, ids[: matched_at + 1]).endswith("STOP")  # stopped on the completing token
    assert detok.output_text == ("hello STOP" if include else "hello ")


def test_stop_inside_one_token_and_earliest_of_several(tokenizer):
    ids = tokenizer.encode("the end is near.")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["near", "nd i"]))
    results = [detok.update([t]) for t in ids]
    assert [r for r in results if r] == ["nd i"]
    assert detok.output_text == "the e"
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["is", "the end is"]))
    assert detok.update(ids) == "the end is"  # both complete in one update: the first to complete wins
    assert detok.output_text == ""


@pytest.mark.parametrize("stops", [["STOP"], ["end.", "wörld 🙂 世"], ["é", "ST"]])
def test_streamed_deltas_rebuild_text_and_never_show_a_stop_string(tokenizer, stops):
    text = TEXT + " STOP after"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stops))
    deltas, stop = _stream(detok, ids)
    assert "".join(deltas) == detok.output_text
    assert stop is not None and text.startswith(detok.output_text + stop)
    for delta in deltas:
        assert not any(s in delta for s in stops)


def test_streaming_holds_back_a_possible_stop_prefix_and_releases_it(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"]))
    ids = tokenizer.encode("hello ST")
    for t in ids:
        detok.update([t])
    assert detok.get_next_delta_text() == "hello "  # "ST" may become "STOP"
    assert detok.get_next_delta_text() == ""
    detok.update(tokenizer.encode("ay"))
    assert detok.get_next_delta_text() == "STay"
    detok.update(tokenizer.encode(" S"))
    assert detok.get_next_delta_text() == " "
    detok.finish()  # finished for another reason (length, EOS): release the held tail
    assert detok.get_next_delta_text() == "S"
    assert detok.output_text == "hello STay S"


def test_include_stop_str_streams_the_stop_string(tokenizer):
    detok = IncrementalDetokenizer(
        tokenizer, [], SamplingParams(stop=["STOP"], include_stop_str_in_output=True)
    )
    deltas, stop = _stream(detok, tokenizer.encode("go STOP now"))
    assert stop == "STOP" and "".join(deltas) == detok.output_text == "go STOP"


def test_skip_special_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    ids = [*tokenizer.encode("hi"), eos, *tokenizer.encode(" there")]
    for skip, expected in [(True, "hi there"), (False, "hi<|im_end|> there")]:
        detok = IncrementalDetokenizer(tokenizer, [eos], SamplingParams(skip_special_tokens=skip))
        for t in ids:
            detok.update([t])
        assert detok.output_text == expected


def test_stop_terminated_token_is_left_out(tokenizer):
    ids = tokenizer.encode("yes.")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop_token_ids=[ids[-1]]))
    detok.update(ids[:-1])
    assert detok.update(ids[-1:], stop_terminated=True) is None
    assert detok.output_text == "yes" and detok.output_token_ids == ids


def test_ids_outside_the_tokenizer_vocab_decode_to_nothing(tokenizer):
    big = len(tokenizer) + 100
    detok = IncrementalDetokenizer(tokenizer, [big, 1], SamplingParams())
    ids = [*tokenizer.encode("ok "), big, -1, *tokenizer.encode("fine")]
    for t in ids:
        detok.update([t])
    assert detok.output_text == "ok fine" and detok.output_token_ids == ids


def test_min_tokens_defers_stop_strings(tokenizer):
    ids = tokenizer.encode("STOP and STOP")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"], min_tokens=4))
    deltas, stop = _stream(detok, ids)
    assert stop == "STOP" and detok.output_text == "STOP and "
    assert "".join(deltas) == detok.output_text


def test_plain_tokenizers_tokenizer_and_detokenize_false(raw_tokenizer, tokenizer):
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(raw_tokenizer, [], SamplingParams(stop=["café"]))
    for t in ids:
        if detok.update([t]):
            break
    assert detok.output_text == TEXT[: TEXT.index("café")]
    quiet = IncrementalDetokenizer(tokenizer, [], SamplingParams(detokenize=False))
    assert quiet.update(ids) is None and quiet.output_text == "" and quiet.get_next_delta_text() == ""


def test_prompt_context_is_the_last_in_vocab_prompt_ids(tokenizer):
    big = len(tokenizer) + 7
    prompt = [*tokenizer.encode(TEXT * 50), 11, big, 12, 13, -1, 14, 15, big]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    assert detok._ids == [11, 12, 13, 14, 15]
    assert IncrementalDetokenizer(tokenizer, [big, 3], SamplingParams())._ids == [3]
    # Without detokenization no context is kept at all.
    assert IncrementalDetokenizer(tokenizer, prompt, SamplingParams(detokenize=False))._ids == []


def test_admission_does_not_walk_the_prompt(tokenizer, monkeypatch):
    """Building a request's detokenizer looks at the prompt's last few ids, not all of them."""
    calls = []
    original = IncrementalDetokenizer._in_vocab
    monkeypatch.setattr(
        IncrementalDetokenizer, "_in_vocab", lambda self, t: calls.append(t) or original(self, t)
    )
    prompt = [1 + i % (len(tokenizer) - 1) for i in range(20000)]  # all in the vocabulary
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    assert len(calls) == 5 and detok._ids == prompt[-5:]
