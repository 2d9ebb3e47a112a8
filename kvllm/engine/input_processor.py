"""InputProcessor: what a request brings in, made ready for the engine.

Prompts become token ids (truncated to `truncate_prompt_tokens`) and are checked against the model,
sampling parameters' token ids are checked against the vocabulary and their bad words tokenized,
conversations are rendered with the chat template, and unset sampling fields take the model's
generation_config.json defaults. LLM and
LLMEngine use it; the OpenAI server shares the generation-config rule and renders chats with its
own bounded renderer (entrypoints/chat_utils.py), mapping errors to OpenAI's shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvllm.models.model_config import ModelConfig

PromptType = str | list[int] | dict[str, Any]
ChatMessage = dict[str, Any]


def with_generation_defaults(fields: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams fields as a request gave them: set ones (not None) win, unset ones take the
    model's generation_config.json default where it has one (vLLM's rule), the rest stay out."""
    return {
        name: defaults[name] if value is None else value
        for name, value in fields.items()
        if value is not None or name in defaults
    }


def truncate_prompt(
    token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int, side: str = "left"
) -> list[int]:
    """The last `truncate_prompt_tokens` tokens of the prompt (-1: the last max_model_len; None: all);
    the first ones with side="right" (vLLM's truncation_side).

    vLLM's rule: more than max_model_len is refused, since no prompt may be that long.
    """
    if truncate_prompt_tokens is None:
        return token_ids
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if keep > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens={truncate_prompt_tokens} is not valid; allowed: -1 or an integer from 1 "
            f"to max_model_len ({max_model_len})"
        )
    if len(token_ids) <= keep:
        return token_ids
    return token_ids[:keep] if side == "right" else token_ids[-keep:]


def bad_words_token_ids(tokenizer: Any, bad_words: list[str]) -> list[list[int]]:
    """Token sequences to ban for `bad_words`, as vLLM tokenizes them: each word alone, and with a
    leading space when that gives a different first token and as many tokens (so the word is banned
    at the start of the text and after a space)."""
    sequences: list[list[int]] = []
    for word in bad_words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if not alone:
            raise ValueError(f"bad_words={[word]!r} is not valid: the word has no tokens")
        sequences.append(list(alone))
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(list(spaced))
    return sequences


class InputProcessor:
    """Tokenizes and validates prompts for one model."""

    def __init__(self, tokenizer: Any, model_config: ModelConfig) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text, or None when given as ids; token ids) of a str, a list of ids or a prompt dict."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(map(int, prompt["prompt_token_ids"]))
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError(f"A prompt dict needs 'prompt' or 'prompt_token_ids'; got keys {sorted(prompt)}")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            f"Unsupported prompt of type {type(prompt).__name__}; allowed: a str, a list of token ids, "
            "or a dict with 'prompt' or 'prompt_token_ids'"
        )

    @staticmethod
    def cache_salt(prompt: PromptType) -> str | None:
        """The prompt dict's `cache_salt` (vLLM's key: prefix-cache blocks are shared only between requests
        with the same salt), or None; ValueError unless it is a non-empty string."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt={salt!r} is not valid; allowed: a non-empty string, or none")
        return salt

    def validate_prompt(self, token_ids: list[int], room_to_generate: bool = True) -> None:
        """ValueError unless the prompt is non-empty, leaves room to generate (a pooling prompt may fill
        max_model_len) and stays in the vocabulary."""
        if not token_ids:
            raise ValueError("The prompt is empty: at least one token is needed")
        max_len = self.model_config.max_model_len
        if not room_to_generate and len(token_ids) > max_len:
            raise ValueError(
                f"The input is {len(token_ids)} tokens long, more than max_model_len={max_len}; shorten it "
                "or set truncate_prompt_tokens"
            )
        if room_to_generate and len(token_ids) >= max_len:
            raise ValueError(
                f"The prompt is {len(token_ids)} tokens long, which leaves no room to generate within "
                f"max_model_len={max_len}; shorten the prompt or raise max_model_len"
            )
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            bad = next(t for t in token_ids if not 0 <= t < vocab)
            raise ValueError(f"Token id {bad} is out of range; allowed: 0 <= id < {vocab} (the vocabulary)")

    def truncate_prompt(self, token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as the request's `truncate_prompt_tokens` keeps it."""
        return truncate_prompt(token_ids, params.truncate_prompt_tokens, self.model_config.max_model_len)

    def process_params(self, params: SamplingParams) -> SamplingParams:
        """`params` with token ids checked against the model and bad words tokenized (a copy then).

        ValueError naming the field for ids outside the vocabulary: allowed_token_ids must be tokens
        of the tokenizer (vLLM's rule), logit_bias ids rows of the logits.
        """
        vocab = self.model_config.vocab_size
        if params.logit_bias:
            bad = sorted(t for t in params.logit_bias if t >= vocab)
            if bad:
                raise ValueError(
                    f"logit_bias={ {t: params.logit_bias[t] for t in bad[:10]} } is not valid: token id(s) "
                    f"out of range; allowed: 0 <= id < {vocab} (the vocabulary)"
                )
        if params.allowed_token_ids is not None:
            limit = min(vocab, len(self.tokenizer))
            bad = sorted({t for t in params.allowed_token_ids if t >= limit})
            if bad:
                raise ValueError(
                    f"allowed_token_ids={bad[:10]} is not valid: token id(s) out of range; allowed: "
                    f"0 <= id < {limit} (the tokenizer's vocabulary)"
                )
        if not params.bad_words:
            return params
        sequences = bad_words_token_ids(self.tokenizer, params.bad_words)
        bad = sorted({t for word in sequences for t in word if not 0 <= t < vocab})
        if bad:
            raise ValueError(
                f"bad_words={params.bad_words!r} is not valid: they tokenize to id(s) {bad[:10]}, outside "
                f"the model's vocabulary of {vocab}"
            )
        processed = params.clone()
        processed._bad_words_token_ids = sequences
        return processed

    def max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """Tokens the request may generate: its max_tokens, capped by what max_model_len leaves."""
        room = self.model_config.max_model_len - num_prompt_tokens
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def render_chat(
        self,
        conversation: list[ChatMessage],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a conversation under the tokenizer's chat template."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "This model's tokenizer has no chat template; use generate() with a plain prompt"
            )
        text = self.tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults applied."""
        return SamplingParams(**self.model_config.default_sampling)
