"""ServingLimits: what one request to `kvllm serve` may ask of the server, so one client cannot starve
the others or stall the event loop.

The `kvllm serve` flags are generated from these fields (help text from field metadata), so the
flags, `build_app(limits=...)` and the help cannot drift. A request over a limit gets a 400 (413 for
the body size) that names the limit and its flag. No torch is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

MiB = 1 << 20


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class ServingLimits:
    """Per-request limits of the OpenAI-compatible server, with defaults that protect other users."""

    max_n_sequences: int = field(
        default=64,
        metadata=_help(
            "Most completions one prompt may ask for (the request's n). vLLM sets this with the "
            "VLLM_MAX_N_SEQUENCES environment variable (default 16384 there)."
        ),
    )
    max_prompts_per_request: int = field(
        default=64, metadata=_help("Most prompts one /v1/completions request may carry (a list of prompts).")
    )
    max_stop_strings: int = field(default=32, metadata=_help("Most stop strings one request may give."))
    max_generation_tokens_per_request: int = field(
        default=1 << 18,
        metadata=_help(
            "Most tokens one request may ask to generate: n x max_tokens, summed over its prompts (a "
            "chat request without max_tokens counts the room left in the context)."
        ),
    )
    max_request_body_bytes: int = field(
        default=4 * MiB,
        metadata=_help("Largest request body accepted, in bytes; larger ones get 413 before they are read."),
    )
    trust_request_chat_template: bool = field(
        default=False,
        metadata=_help(
            "Render chat templates sent in requests (chat_template, or chat_template_kwargs.chat_template), "
            "as vLLM's flag of the same name; without it such requests get 400 and only the model's "
            "template is used. Templates always render sandboxed and bounded in time and size."
        ),
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(f.default, bool):
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name}={value!r} is not valid; allowed: true or false")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name}={value!r} is not valid; allowed: a positive integer")

    @staticmethod
    def flag(name: str) -> str:
        """The `kvllm serve` flag of a field, for error messages: `--max-n-sequences`."""
        return f"--{name.replace('_', '-')}"

    def describe(self, name: str) -> str:
        """`max_n_sequences=64 (--max-n-sequences)`: a limit as an error message names it."""
        return f"{name}={getattr(self, name)} ({self.flag(name)})"

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> ServingLimits:
        """Limits from keyword arguments that may hold other settings too (an argparse namespace's)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in kwargs.items() if k in names})
