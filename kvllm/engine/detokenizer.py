"""IncrementalDetokenizer: token ids -> output text, stop strings and streaming deltas for one sequence.

Decoding is incremental with two offsets into the decoded ids (the prefix/read-offset scheme of
HF TGI and vLLM): each step decodes only ids[prefix_offset:] and ids[prefix_offset:read_offset] and
emits the difference. Text ending in U+FFFD (an incomplete UTF-8 sequence from byte-level BPE) is
held until a later token completes it, so emitted text never changes afterwards. The last few
prompt tokens seed the window, so tokenizers that render a leading space by context (SentencePiece)
decode the first output token correctly. With a Rust (`tokenizers`) tokenizer the same scheme runs
inside the library's `DecodeStream`, one call per token (about 3x faster than two decodes); the
offsets are kept in step with it, so the last incomplete character and a stream error fall back to
the Python path without losing text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from kvllm.sampling_params import SamplingParams

# Prompt tokens kept as decoding context (vLLM uses the same number).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes one sequence's output incrementally and watches for stop strings.

    Invariants: `output_text` only grows (except for the one truncation at a stop string, which
    never cuts below what `get_next_delta_text` has released); released text never contains a stop
    string unless `include_stop_str_in_output`; once finished (by a stop string or `finish()`), the
    deltas concatenated up to and including the next `get_next_delta_text` equal `output_text`.

    `tokenizer` is a transformers tokenizer or a `tokenizers.Tokenizer`. Ids outside its vocabulary
    (a model vocab padded beyond the tokenizer's) decode to nothing.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self._is_hf = hasattr(tokenizer, "convert_ids_to_tokens")
        self._vocab_size: int = (
            len(tokenizer) if self._is_hf else tokenizer.get_vocab_size(with_added_tokens=True)
        )
        self.stop: list[str] = list(params.stop or [])
        self.output_token_ids: list[int] = []
        self._text = ""
        # Ids to decode: a little prompt context (the last in-vocab prompt ids), then the (in-vocab) output ids.
        context = self._prompt_context(prompt_token_ids) if params.detokenize else []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_released = 0
        self._is_finished = False
        self.stop_reason: str | None = None
        self._rust, self._stream = _decode_stream(tokenizer, context, params)

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def is_finished(self) -> bool:
        return self._is_finished

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append generated tokens; return the stop string they completed, else None.

        On a match the text is cut before the stop string (after it with
        `include_stop_str_in_output`) and the detokenizer counts as finished. Pass
        `stop_terminated=True` when the last new token is an EOS / stop token id: it is then left
        out of the text (unless `include_stop_str_in_output`), as in vLLM.
        """
        self.output_token_ids.extend(new_token_ids)
        if not self.params.detokenize or self._is_finished:
            return None
        to_decode = list(new_token_ids)
        if stop_terminated and not self.params.include_stop_str_in_output and to_decode:
            to_decode.pop()
        check_from = len(self._text)
        if self._stream is not None:
            self._text += self._stream_new([t for t in to_decode if self._in_vocab(t)])
        else:
            self._ids.extend(t for t in to_decode if self._in_vocab(t))
            self._text += self._decode_new()
        if not self.stop or len(self.output_token_ids) <= self.params.min_tokens:
            return None
        return self._check_stop_strings(check_from)

    def get_next_delta_text(self) -> str:
        """New text for streaming, holding back a tail that may still become a stop string."""
        end = len(self._text)
        if not self._is_finished:
            end -= self._stop_prefix_holdback()
        if end <= self._num_released:
            return ""
        delta = self._text[self._num_released : end]
        self._num_released = end
        return delta

    def finish_with(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> None:
        """`update(new_token_ids, stop_terminated)` then `finish()`, for a sequence that held its ids
        until its end: where the stream has no ids pending, one decode of the window gives the text the
        stream would give token by token (its pieces concatenate to the decode of the window), several
        times faster than a stream step per id."""
        nothing_pending = self._stream is not None and self._read_offset == len(self._ids)
        if nothing_pending and not self.stop and not self._is_finished:
            if self._finish_in_one_decode(new_token_ids, stop_terminated):
                return
        self.update(new_token_ids, stop_terminated)
        self.finish()

    def _finish_in_one_decode(self, new_token_ids: Sequence[int], stop_terminated: bool) -> bool:
        """finish_with's one decode; False (nothing changed) for a decoder that rewrites earlier text."""
        to_decode = list(new_token_ids)
        if stop_terminated and not self.params.include_stop_str_in_output and to_decode:
            to_decode.pop()
        window = self._ids[self._prefix_offset :]
        new_ids = [t for t in to_decode if self._in_vocab(t)]
        skip = self.params.skip_special_tokens
        before = self._rust.decode(window, skip_special_tokens=skip)
        after = self._rust.decode(window + new_ids, skip_special_tokens=skip)
        if not after.startswith(before):
            return False
        self.output_token_ids.extend(new_token_ids)
        self._ids.extend(new_ids)
        self._text += after[len(before) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._is_finished = True
        return True

    def finish(self) -> None:
        """Mark the sequence finished: the next `get_next_delta_text` releases all remaining text.

        Ids still pending an incomplete UTF-8 sequence are decoded as they are (with U+FFFD), so the
        final text equals the tokenizer's decode of the output. Calling it again does nothing.
        """
        if not self._is_finished and self.params.detokenize and self._read_offset < len(self._ids):
            self._text += self._decode_new(force=True)
        self._is_finished = True

    def _in_vocab(self, token_id: int) -> bool:
        return 0 <= token_id < self._vocab_size

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The last _PROMPT_CONTEXT_TOKENS in-vocab prompt ids, read from the end (a request's admission
        must not cost a Python step per prompt token)."""
        context: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if self._in_vocab(token_id):
                context.append(token_id)
                if len(context) == _PROMPT_CONTEXT_TOKENS:
                    break
        context.reverse()
        return context

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        skip = self.params.skip_special_tokens
        if self._is_hf:
            return self.tokenizer.decode(
                ids,
                skip_special_tokens=skip,
                clean_up_tokenization_spaces=False,
                spaces_between_special_tokens=self.params.spaces_between_special_tokens,
            )
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def _decode_new(self, force: bool = False) -> str:
        """Text added by ids[read_offset:], or "" while it ends in an incomplete character."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if not force and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)):
            return ""  # an incomplete character, or tokens that render as nothing (yet)
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

    def _stream_new(self, ids: list[int]) -> str:
        """`_decode_new` for each id through the DecodeStream, with the same offsets."""
        pieces = []
        for token_id in ids:
            self._ids.append(token_id)
            try:
                piece = self._stream.step(self._rust, token_id)
            except Exception:  # e.g. a decoder whose text is not prefix-stable: decode in Python
                self._stream = None
                pieces.append(self._decode_new())
                continue
            if piece is not None:
                pieces.append(piece)
                self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return "".join(pieces)

    def _check_stop_strings(self, check_from: int) -> str | None:
        """Find the stop string that completes first in text added after `check_from`."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stop:
            start = self._text.find(stop, max(0, check_from - len(stop) + 1))
            if start != -1:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        if best is None:
            return None
        end, start, stop = best
        self._text = self._text[: end if self.params.include_stop_str_in_output else start]
        self._is_finished = True
        self.stop_reason = stop
        return stop

    def _stop_prefix_holdback(self) -> int:
        """Length of the longest text tail that is a proper prefix of a stop string."""
        if not self.stop or self.params.include_stop_str_in_output:
            return 0
        text = self._text
        hold = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return min(hold, len(text) - self._num_released)


def _decode_stream(
    tokenizer: Any, context: list[int], params: SamplingParams
) -> tuple[Tokenizer | None, DecodeStream | None]:
    """The Rust tokenizer and a DecodeStream seeded with `context`, where they decode as `_decode` does:
    a `tokenizers.Tokenizer`, or a transformers fast tokenizer (whose decode is its backend's; its
    `spaces_between_special_tokens` is a slow-tokenizer option, honoured by the Python path)."""
    rust = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(rust, Tokenizer) or not params.detokenize or not params.spaces_between_special_tokens:
        return None, None
    if rust.decode(context, skip_special_tokens=params.skip_special_tokens).endswith(_REPLACEMENT_CHAR):
        return None, None  # a stream seeded mid-character emits the context's text: decode in Python
    try:
        return rust, DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)
    except TypeError:  # tokenizers < 0.22: no context seeding
        return None, None
