"""InputProcessor: what a request brings in, made ready for the engine.

Prompts become token ids and are checked against the model, conversations are rendered with the
chat template, and unset sampling fields take the model's generation_config.json defaults. LLM and
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
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError(f"A prompt dict needs 'prompt' or 'prompt_token_ids'; got keys {sorted(prompt)}")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            f"Unsupported prompt of type {type(prompt).__name__}; allowed: a str, a list of token ids, "
            "or a dict with 'prompt' or 'prompt_token_ids'"
        )

    def validate_prompt(self, token_ids: list[int]) -> None:
        """ValueError unless the prompt is non-empty, leaves room to generate and stays in the vocabulary."""
        if not token_ids:
            raise ValueError("The prompt is empty: at least one token is needed")
        max_len = self.model_config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"The prompt is {len(token_ids)} tokens long, which leaves no room to generate within "
                f"max_model_len={max_len}; shorten the prompt or raise max_model_len"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"Token id {bad[0]} is out of range; allowed: 0 <= id < {vocab} (the vocabulary)"
            )

    def max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """Tokens the request may generate: its max_tokens, capped by what max_model_len leaves."""
        room = self.model_config.max_model_len - num_prompt_tokens
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def render_chat(
        self,
        conversation: list[ChatMessage],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a conversation under the tokenizer's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "This model's tokenizer has no chat template; use generate() with a plain prompt"
            )
        text = self.tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults applied."""
        return SamplingParams(**self.model_config.default_sampling)
