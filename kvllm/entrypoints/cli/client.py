"""`kvllm chat` and `kvllm complete`: talk to a running OpenAI-compatible server from the terminal, as
vLLM's commands of the same names do (same flags), through the `openai` client.

Beyond vLLM's: a request the server refuses prints its message and the session goes on (the turn is
dropped from the conversation); a server that cannot be reached, or a wrong API key, is a one-line
error and exit code 1, not a traceback; Ctrl-C or end of input ends the session with code 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

DEFAULT_URL = "http://localhost:8000/v1"


def register(subparsers: Any) -> None:
    """Add the `chat` and `complete` subcommands."""
    chat = subparsers.add_parser(
        "chat",
        allow_abbrev=False,
        help="Chat with a running server (e.g. kvllm serve) from the terminal.",
        description="Chat with the model of a running OpenAI-compatible server, streaming its replies; "
        "the conversation is kept across turns. End with Ctrl-D or Ctrl-C.",
    )
    _add_server_flags(chat)
    chat.add_argument("--system-prompt", default=None, help="A system message put first in the conversation.")
    chat.add_argument(
        "-q", "--quick", metavar="MESSAGE", default=None, help="Send this one message, print the reply, exit."
    )
    chat.add_argument(
        "--stats", action="store_true", help="Print TTFT and tokens per second after each reply."
    )
    chat.set_defaults(dispatch=run_chat)

    complete = subparsers.add_parser(
        "complete",
        allow_abbrev=False,
        help="Complete prompts with a running server (e.g. kvllm serve) from the terminal.",
        description="Send prompts to the /v1/completions route of a running OpenAI-compatible server and "
        "stream the completions. End with Ctrl-D or Ctrl-C.",
    )
    _add_server_flags(complete)
    complete.add_argument(
        "--max-tokens", type=int, default=None, help="Most tokens per completion (default: the server's)."
    )
    complete.add_argument(
        "-q", "--quick", metavar="PROMPT", default=None, help="Complete this one prompt, print it, exit."
    )
    complete.add_argument(
        "--stats", action="store_true", help="Print TTFT and tokens per second after each completion."
    )
    complete.set_defaults(dispatch=run_complete)


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=DEFAULT_URL, help=f"The server's OpenAI API base URL (default: {DEFAULT_URL})."
    )
    parser.add_argument(
        "--model-name",
        default=None,
        help="The model to ask for (default: the first one the server lists at /v1/models).",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="The server's API key (default: OPENAI_API_KEY, else KVLLM_API_KEY, else VLLM_API_KEY, else none).",
    )


def api_key(flag: str | None, environ: dict[str, str] | os._Environ[str]) -> str:
    for value in (
        flag,
        environ.get("OPENAI_API_KEY"),
        environ.get("KVLLM_API_KEY"),
        environ.get("VLLM_API_KEY"),
    ):
        if value:
            return value
    return "EMPTY"  # the openai client insists on a key; a server without one ignores it


def run_chat(args: argparse.Namespace) -> int:
    """The `chat` session; returns the exit code."""
    session = _Session(args)
    conversation: list[dict[str, str]] = []
    if args.system_prompt is not None:
        conversation.append({"role": "system", "content": args.system_prompt})

    def turn(message: str) -> bool:
        conversation.append({"role": "user", "content": message})
        reply = session.stream(
            lambda: session.client.chat.completions.create(
                model=session.model, messages=conversation, stream=True, **session.usage_option
            ),
            _chat_text,
        )
        if reply is None:
            conversation.pop()  # refused: the conversation stays as it was
            return False
        conversation.append({"role": "assistant", "content": reply})
        return True

    return session.run(args.quick, turn, "Please enter a message for the chat model:")


def run_complete(args: argparse.Namespace) -> int:
    """The `complete` session; returns the exit code."""
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens} is not valid; allowed: >= 1")
    session = _Session(args)
    extra = {"max_tokens": args.max_tokens} if args.max_tokens is not None else {}

    def turn(prompt: str) -> bool:
        text = session.stream(
            lambda: session.client.completions.create(
                model=session.model, prompt=prompt, stream=True, **extra, **session.usage_option
            ),
            _completion_text,
        )
        return text is not None

    return session.run(args.quick, turn, "Please enter prompt to complete:")


def _chat_text(chunk: Any) -> str | None:
    return chunk.choices[0].delta.content if chunk.choices else None


def _completion_text(chunk: Any) -> str | None:
    return chunk.choices[0].text if chunk.choices else None


class _ServerUnreachable(Exception):
    pass


class _Session:
    """The client, the model it asks for, and how a turn's stream is printed."""

    def __init__(self, args: argparse.Namespace) -> None:
        import openai

        self.openai = openai
        self.url = args.url
        self.stats = args.stats
        self.usage_option: dict[str, Any] = {"stream_options": {"include_usage": True}} if args.stats else {}
        self.client = openai.OpenAI(api_key=api_key(args.api_key, os.environ), base_url=args.url)
        self.model = args.model_name
        self.ready_error: str | None = None
        if self.model is None:
            try:
                models = self.client.models.list().data
            except openai.APIError as exc:
                self.ready_error = self._describe(exc)
                return
            if not models:
                self.ready_error = f"The server at {self.url} lists no models; give --model-name"
                return
            self.model = models[0].id
        print(f"Using model: {self.model}")

    def run(self, quick: str | None, turn: Callable[[str], bool], prompt_line: str) -> int:
        if self.ready_error is not None:
            print(f"kvllm: error: {self.ready_error}", file=sys.stderr)
            return 1
        try:
            if quick is not None:
                return 0 if turn(quick) else 1
            print(prompt_line)
            while True:
                try:
                    message = input("> ")
                except EOFError:
                    print()
                    return 0
                turn(message)
        except KeyboardInterrupt:
            print()
            return 0
        except _ServerUnreachable as exc:
            print(f"kvllm: error: {exc}", file=sys.stderr)
            return 1

    def stream(self, create: Callable[[], Iterable[Any]], text_of: Callable[[Any], str | None]) -> str | None:
        """Print one streamed answer as it arrives; its text, or None when the server refused the request
        (its message printed). Raises _ServerUnreachable when there is no server to talk to."""
        start = time.perf_counter()
        first: float | None = None
        tokens = 0
        parts: list[str] = []
        try:
            for chunk in create():
                if getattr(chunk, "usage", None) is not None:
                    tokens = chunk.usage.completion_tokens
                text = text_of(chunk)
                if text:
                    first = first if first is not None else time.perf_counter() - start
                    parts.append(text)
                    print(text, end="", flush=True)
        except (self.openai.APIConnectionError, self.openai.AuthenticationError) as exc:
            raise _ServerUnreachable(self._describe(exc)) from None
        except self.openai.APIError as exc:
            if parts:
                print()
            print(f"error: {self._describe(exc)}", file=sys.stderr)
            return None
        print()
        if self.stats and first is not None:
            elapsed = time.perf_counter() - start
            print(f"{'TTFT:':<5} {first * 1000:.2f} ms")
            print(f"{'TPS:':<5} {tokens / elapsed:.2f} tokens/s ({tokens} tokens in {elapsed:.2f}s)")
        return "".join(parts)

    def _describe(self, exc: Exception) -> str:
        if isinstance(exc, self.openai.APIConnectionError):
            return f"no server answered at {self.url} ({exc}); start one with `kvllm serve`, or give --url"
        if isinstance(exc, self.openai.AuthenticationError):
            return f"the server at {self.url} refused the API key; give --api-key (or set OPENAI_API_KEY)"
        if isinstance(exc, self.openai.APIStatusError):
            body = exc.body if isinstance(exc.body, dict) else {}
            message = body.get("message") or (body.get("error") or {}).get("message") or str(exc)
            return f"{exc.status_code}: {message}"
        return str(exc)
