"""vLLM's development routes for sleep mode: POST /sleep?level=N, POST /wake_up[?tags=...], GET
/is_sleeping. Mounted, as in vLLM, only with VLLM_SERVER_DEV_MODE=1 (or KVLLM_SERVER_DEV_MODE=1): a
client that can put the engine to sleep can take the server down for everyone.

Sleeping needs an idle engine (409 while requests are unfinished); while asleep, generation
requests get 503 naming /wake_up. The calls run on the engine thread, between steps.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from fastapi import FastAPI, Query
from fastapi.responses import Response

from kvllm.engine.async_llm import AsyncLLM, EngineDeadError, EngineNotAcceptingError
from kvllm.engine.llm_engine import LLMEngine
from kvllm.entrypoints.openai.errors import OpenAIError, error_responses, to_openai_error
from kvllm.entrypoints.openai.metrics import PrometheusStatLogger
from kvllm.logger import init_logger

logger = init_logger(__name__)

DEV_MODE_VARIABLES = ("KVLLM_SERVER_DEV_MODE", "VLLM_SERVER_DEV_MODE")
PATHS = ("/sleep", "/wake_up", "/is_sleeping")
EngineError = (EngineDeadError, EngineNotAcceptingError)


def dev_mode(environ: Mapping[str, str] = os.environ) -> bool:
    return any(
        environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in DEV_MODE_VARIABLES
    )


def add_sleep_routes(app: FastAPI, llm: AsyncLLM, prometheus: PrometheusStatLogger, protected: bool) -> None:
    auth = (401,) if protected else ()

    @app.post("/sleep", responses=error_responses(400, *auth, 503))
    async def sleep(level: int = Query(default=1)) -> Response:
        try:
            await llm.call_engine(lambda engine: engine.sleep(level))
        except ValueError as exc:  # not a sleep level
            raise OpenAIError.bad_request(exc) from None
        except RuntimeError as exc:  # unfinished requests, or already asleep
            raise (
                to_openai_error(exc) if isinstance(exc, EngineError) else OpenAIError(str(exc), 409)
            ) from None
        prometheus.record_sleep_state(sleeping=True, level=level)
        return Response(status_code=200)

    @app.post("/wake_up", responses=error_responses(400, *auth, 503))
    async def wake_up(tags: list[str] | None = Query(default=None)) -> Response:
        level = llm.engine.sleep_level

        def wake(engine: LLMEngine) -> bool:
            engine.wake_up(tags)
            return engine.is_sleeping()

        try:
            sleeping = await llm.call_engine(wake)
        except Exception as exc:
            raise to_openai_error(exc) from None  # unknown tags: 400
        prometheus.record_sleep_state(sleeping=sleeping, level=level)
        return Response(status_code=200)

    @app.get("/is_sleeping", responses=error_responses(*auth))
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": llm.engine.is_sleeping()}
