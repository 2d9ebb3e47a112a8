"""vLLM's request logs (--enable-log-requests, --enable-log-outputs, --max-log-len): each request's prompt
and sampling parameters when the engine takes it, and its output when it finishes, at INFO.

Off by default, as in vLLM: prompts and outputs are users' data. --max-log-len bounds the characters of
a logged text and the ids of a logged token list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvllm.engine.async_llm import RequestStream
from kvllm.logger import init_logger
from kvllm.outputs import RequestOutput

logger = init_logger(__name__)


@dataclass(frozen=True)
class RequestLogger:
    log_outputs: bool = False
    max_log_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(
                f"--max-log-len {self.max_log_len} is not valid; allowed: >= 0, or unset for all"
            )

    def _clip(self, value: Any) -> Any:
        if value is None or self.max_log_len is None:
            return value
        return value[: self.max_log_len]

    def log_inputs(self, request_id: str, prompt: dict[str, Any], params: Any) -> None:
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
            request_id,
            self._clip(prompt.get("prompt")),
            params,
            self._clip(prompt.get("prompt_token_ids")),
        )

    def log_output(self, request_id: str, output: RequestOutput) -> None:
        for c in output.outputs:
            logger.info(
                "Generated response %s%s: output: %r, output_token_ids: %s, finish_reason: %s",
                request_id,
                f" (sequence {c.index})" if len(output.outputs) > 1 else "",
                self._clip(c.text),
                self._clip(list(c.token_ids)),
                c.finish_reason,
            )

    def watch(self, stream: RequestStream) -> RequestStream | LoggedStream:
        """`stream`, logging its request's output when it finishes (with --enable-log-outputs)."""
        return LoggedStream(stream, self) if self.log_outputs else stream


class LoggedStream:
    """A RequestStream whose finished output is logged as it passes (same iteration and close())."""

    def __init__(self, stream: RequestStream, request_logger: RequestLogger) -> None:
        self.stream = stream
        self.request_logger = request_logger
        self.request_id = stream.request_id

    def __aiter__(self) -> LoggedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        output = await self.stream.__anext__()
        if output.finished and isinstance(output, RequestOutput):
            self.request_logger.log_output(self.request_id, output)
        return output

    def close(self) -> None:
        self.stream.close()
