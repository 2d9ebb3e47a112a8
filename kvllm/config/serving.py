"""ServingLimits: what one request to `kvllm serve` may ask of the server, so one client cannot starve
the others or stall the event loop.

The `kvllm serve` flags are generated from these fields (help text from field metadata), so the
flags, `build_app(limits=...)` and the help cannot drift. A request over a limit gets a 400 (413 for
the body size) that names the limit and its flag. No torch is imported here.
"""

from __future__ import annotations

import codecs
import json
import os
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


@dataclass(frozen=True)
class HttpOptions:
    """How `kvllm serve` listens and answers at the HTTP level: socket, TLS, CORS, proxy path, docs.

    vLLM's frontend flags of the same names. One difference, on purpose: vLLM answers every origin
    (CORS `*`) unless told otherwise; kvllm sends no CORS headers unless a CORS flag is given, so a
    web page in the user's browser cannot read a local server's answers. `--allowed-origins '["*"]'`
    gives vLLM's behaviour.
    """

    uds: str | None = None
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE; 1 = CERT_OPTIONAL, 2 = CERT_REQUIRED
    ssl_ciphers: str | None = None
    allowed_origins: tuple[str, ...] | None = None  # None: no CORS middleware
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    disable_fastapi_docs: bool = False
    h11_max_incomplete_event_size: int | None = None
    disable_access_log_for_endpoints: tuple[str, ...] = ()
    enable_request_id_headers: bool = False  # X-Request-Id on every answer
    enable_server_load_tracking: bool = False  # GET /load counts the requests on the engine's routes
    # Import paths ("pkg.module.Name") of ASGI middleware: a class goes to app.add_middleware, an async
    # function to @app.middleware("http"), as vLLM's --middleware.
    middleware: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate that goes with the key)")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"--{name.replace('_', '-')} {path!r}: no such file")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(
                f"--ssl-cert-reqs {self.ssl_cert_reqs} is not valid; allowed: 0 (CERT_NONE), "
                "1 (CERT_OPTIONAL), 2 (CERT_REQUIRED)"
            )
        if self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"--root-path {self.root_path!r} must start with '/', e.g. /llm")
        if self.h11_max_incomplete_event_size is not None and self.h11_max_incomplete_event_size < 1:
            raise ValueError("--h11-max-incomplete-event-size must be a positive number of bytes")

    @property
    def cors(self) -> bool:
        return self.allowed_origins is not None


def parse_json_list(flag: str, text: str) -> tuple[str, ...]:
    """vLLM's list flags take JSON (`'["http://a.example", "http://b.example"]'`); one bare value is a
    list of one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = [text]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{flag} {text!r} is not valid; allowed: a JSON list of strings, e.g. '[\"*\"]'")
    return tuple(value)


@dataclass(frozen=True)
class ResponseOptions:
    """What the server adds to its answers, server-wide (vLLM's flags of these names)."""

    enable_prompt_tokens_details: bool = (
        False  # usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    )
    enable_force_include_usage: bool = False  # usage at the end of every stream, asked for or not
    return_tokens_as_token_ids: bool = False  # the default of the request field of that name
    response_role: str = "assistant"  # the reply's role when the request asks for a generation prompt

    def __post_init__(self) -> None:
        if not self.response_role or not self.response_role.strip():
            raise ValueError("--response-role is empty; allowed: a role name such as assistant")


@dataclass(frozen=True)
class ChatTemplateDefaults:
    """The server's chat rendering defaults (vLLM's --chat-template, --default-chat-template-kwargs):
    `template` replaces the model's own; `kwargs` are template variables a request's
    chat_template_kwargs may override."""

    template: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Tool calling (vLLM's flags of these names; see entrypoints/openai/tool_calling.py).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = None  # --reasoning-parser (entrypoints/openai/reasoning_parsers.py)
    # --chat-template-content-format: message content as a string, or as OpenAI's list of parts
    # ("openai"); "auto" looks at whether the template loops over a message's content.
    content_format: str = "auto"

    @classmethod
    def from_cli(
        cls, chat_template: str | None, default_kwargs: str | None, **tool_flags: Any
    ) -> ChatTemplateDefaults:
        kwargs: Any = {}
        if default_kwargs is not None:
            try:
                kwargs = json.loads(default_kwargs)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"--default-chat-template-kwargs is not valid JSON ({exc.msg}); allowed: a JSON object, "
                    "e.g. '{\"enable_thinking\": false}'"
                ) from None
            if not isinstance(kwargs, dict):
                raise ValueError(
                    f"--default-chat-template-kwargs must be a JSON object, got {type(kwargs).__name__}"
                )
        return cls(load_chat_template(chat_template), kwargs, **tool_flags)


def load_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: a file's path (its text), or, when no such file opens and the
    value has Jinja's characters ({, } or a newline), the template itself with backslash escapes
    (a single-line form) decoded. A value that looks like a path but does not open is an error."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        if not any(c in value for c in "{}\n"):
            raise ValueError(
                f"--chat-template {value!r} looks like a file path, but it could not be opened ({exc.strerror}); "
                "allowed: a template file's path, or the template itself"
            ) from None
    try:
        return codecs.decode(value, "unicode_escape")
    except UnicodeError:  # characters beyond Latin-1 carry no escapes to decode: the text as given
        return value
