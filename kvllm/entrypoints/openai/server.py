"""The OpenAI-compatible HTTP server: `build_app` (the FastAPI app) and `run_server` (uvicorn + signals).

Shutdown (SIGINT/SIGTERM): new requests get 503 at once; in-flight requests may finish for
`shutdown_timeout` seconds; the rest are aborted and end with finish_reason "abort"; then uvicorn
closes the connections and the engine thread stops. A second SIGINT/SIGTERM exits without waiting.

Routes beside OpenAI's: /ping (GET and POST) answers as /health and /invocations takes a chat or
completion body and answers as that route (SageMaker's contract, as vLLM serves it);
/reset_prefix_cache (POST) forgets the cached prefixes, or answers 409 while requests hold KV blocks
(vLLM's answer; kvllm mounts it without vLLM's VLLM_SERVER_DEV_MODE); /sleep, /wake_up and
/is_sleeping are mounted with it only (sleep_routes.py). With an API key, /v1/*, /invocations and
those routes need it (see middleware.APIKeyMiddleware).

Engine death (the engine thread crashed): in-flight requests get an error and /health answers 503
at once; once the HTTP requests in flight are answered (at most `shutdown_timeout` s) the process
exits with code 1, so a supervisor restarts it (vLLM's behaviour; `keep_alive_on_engine_death`
keeps it up answering 503, as vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH does).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import signal
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from kvllm.config.engine import EngineArgs
from kvllm.config.serving import ChatTemplateDefaults, HttpOptions, ResponseOptions, ServingLimits
from kvllm.engine.async_llm import AsyncLLM
from kvllm.engine.llm_engine import LLMEngine
from kvllm.entrypoints.chat_utils import ChatTemplateRenderer
from kvllm.entrypoints.openai import http_options
from kvllm.entrypoints.openai.errors import (
    OpenAIError,
    error_response,
    error_responses,
    install_error_handlers,
)
from kvllm.entrypoints.openai.metrics import LoggingStatLogger, PrometheusStatLogger, StatsCollector
from kvllm.entrypoints.openai.middleware import (
    APIKeyMiddleware,
    InFlightMiddleware,
    InFlightRequests,
    RequestBodyLimitMiddleware,
)
from kvllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from kvllm.entrypoints.openai.protocol_embedding import EmbeddingRequest, EmbeddingResponse
from kvllm.entrypoints.openai.protocol_responses import ResponsesRequest
from kvllm.entrypoints.openai.request_logger import RequestLogger
from kvllm.entrypoints.openai.serving_chat import OpenAIServingChat
from kvllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kvllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from kvllm.entrypoints.openai.serving_engine import check_chat_defaults, tokenizer_executor
from kvllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from kvllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from kvllm.entrypoints.openai.sleep_routes import add_sleep_routes, dev_mode
from kvllm.logger import init_logger

logger = init_logger(__name__)
T = TypeVar("T")


def build_app(
    engine_args: EngineArgs | None = None,
    *,
    served_model_name: str | Sequence[str] | None = None,
    api_key: str | Sequence[str] | None = None,
    log_stats_interval: float = 10.0,
    engine: LLMEngine | None = None,
    limits: ServingLimits | None = None,
    chat_defaults: ChatTemplateDefaults | None = None,
    response_options: ResponseOptions | None = None,
    request_logger: RequestLogger | None = None,
) -> FastAPI:
    """The FastAPI app serving one model. Builds the engine from `engine_args` unless `engine` is given.

    The engine thread starts and stops with the app's lifespan. `served_model_name` is the name (or
    names) clients use in "model" (default: the model argument); `api_key` (one key or several)
    protects /v1/*;
    `log_stats_interval` is the period of the stats log line in seconds (0 disables it); `limits`
    bound what one request may ask for; `chat_defaults` are --chat-template and
    --default-chat-template-kwargs; `response_options` what the answers carry (usage details, ...);
    `request_logger` logs requests and outputs (--enable-log-requests, off when None).
    """
    limits = limits or ServingLimits()
    chat_defaults = chat_defaults or ChatTemplateDefaults()
    check_chat_defaults(chat_defaults)
    if engine is None:
        engine = LLMEngine.from_engine_args(engine_args or EngineArgs())
    if isinstance(served_model_name, str):
        names = [served_model_name]
    else:
        names = list(served_model_name or [engine.model_config.model])
    registry = CollectorRegistry()
    logging_stats = LoggingStatLogger()
    prometheus = PrometheusStatLogger.for_engine(registry, names[0], engine)
    llm = AsyncLLM(engine, [StatsCollector([prometheus, logging_stats])])
    executor = tokenizer_executor()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await llm.start()
        log_task = (
            asyncio.create_task(_log_stats(logging_stats, log_stats_interval))
            if log_stats_interval > 0
            else None
        )
        try:
            yield
        finally:
            if log_task is not None:
                log_task.cancel()
            await llm.shutdown()
            executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvllm OpenAI-compatible server", lifespan=lifespan)
    app.state.llm = llm
    app.state.registry = registry
    app.state.served_model_names = names
    app.state.in_flight = InFlightRequests()
    app.state.server_load = 0  # counted only with --enable-server-load-tracking (ServerLoadMiddleware)
    # Starlette runs the last added outermost: count every request, then check keys, then body sizes.
    app.add_middleware(RequestBodyLimitMiddleware, max_bytes=limits.max_request_body_bytes)
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    app.add_middleware(InFlightMiddleware, tracker=app.state.in_flight)
    install_error_handlers(app)
    renderer = ChatTemplateRenderer()
    serving = [
        cls(llm, names, limits, executor, renderer, chat_defaults, response_options, request_logger)
        for cls in _SERVING_CLASSES
    ]
    _add_routes(app, llm, names, registry, serving, protected=bool(api_keys))
    if dev_mode():
        add_sleep_routes(app, llm, prometheus, protected=bool(api_keys))
    return app


_SERVING_CLASSES = (
    OpenAIServingCompletion,
    OpenAIServingChat,
    OpenAIServingTokenization,
    OpenAIServingResponses,
    OpenAIServingEmbedding,
)


async def _log_stats(stat_logger: LoggingStatLogger, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        stat_logger.log_interval()


def _add_routes(
    app: FastAPI,
    llm: AsyncLLM,
    names: list[str],
    registry: CollectorRegistry,
    serving: list[Any],
    protected: bool,
) -> None:
    completions, chat, tokenization, responses, embeddings = serving
    auth = (401,) if protected else ()
    generation_errors = error_responses(400, *auth, 404, 413, 500, 503)
    text_errors = error_responses(400, 404, 413, 500)

    def check_serving() -> None:
        if llm.errored:
            raise OpenAIError(
                f"The engine has stopped after an error ({llm.dead_error!r}); restart the server", 503
            )
        if not llm.is_accepting:
            raise OpenAIError("The server is shutting down and takes no new requests", 503)

    def check_generative(api: str) -> None:
        check_serving()
        if llm.engine.model_config.is_pooling:  # vLLM registers no generation routes for these
            raise OpenAIError(
                f"The model does not support the {api} API: it is served with --runner pooling (use "
                "/v1/embeddings, or serve a generative model)",
                404,
            )

    @app.post("/v1/completions", response_model=None, responses=generation_errors)
    async def create_completion(body: CompletionRequest, raw: Request) -> Any:
        check_generative("Completions")
        return _as_response(await _until_disconnect(raw, completions.create_completion(body)))

    @app.post("/v1/chat/completions", response_model=None, responses=generation_errors)
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Any:
        check_generative("Chat Completions")
        return _as_response(await _until_disconnect(raw, chat.create_chat_completion(body)))

    @app.post("/v1/responses", response_model=None, responses=generation_errors)
    async def create_response(body: ResponsesRequest, raw: Request) -> Any:
        check_generative("Responses")
        return _as_response(await _until_disconnect(raw, responses.create_response(body)))

    @app.post("/v1/embeddings", response_model=None, responses=generation_errors)
    async def create_embedding(body: EmbeddingRequest, raw: Request) -> EmbeddingResponse | Response:
        check_serving()
        return await _until_disconnect(raw, embeddings.create_embedding(body))

    @app.post("/invocations", response_model=None, responses=generation_errors)
    async def invocations(raw: Request) -> Any:
        """SageMaker's route: a chat body ("messages") as /v1/chat/completions, else a completion
        body ("prompt") as /v1/completions (vLLM's order: chat first); for a pooling model, an
        embeddings body ("input") as /v1/embeddings."""
        check_serving()
        body = await _json_object(raw)
        if llm.engine.model_config.is_pooling:
            request = _validated(EmbeddingRequest, body)
            return await _until_disconnect(raw, embeddings.create_embedding(request))
        if "messages" in body:
            request = _validated(ChatCompletionRequest, body)
            return _as_response(await _until_disconnect(raw, chat.create_chat_completion(request)))
        if "prompt" in body:
            request = _validated(CompletionRequest, body)
            return _as_response(await _until_disconnect(raw, completions.create_completion(request)))
        raise OpenAIError(
            "/invocations takes a chat completion request (with messages) or a completion request (with "
            f"prompt); the body has neither (its fields: {', '.join(sorted(body)) or 'none'})"
        )

    @app.post("/reset_prefix_cache", responses={**error_responses(400, *auth, 503), 409: _CONFLICT})
    async def reset_prefix_cache(
        reset_running_requests: bool = Query(default=False), reset_external: bool = Query(default=False)
    ) -> Response:
        if reset_running_requests:
            raise OpenAIError(
                "reset_running_requests=true is not supported: kvllm does not preempt running requests to "
                "reset the cache; retry when they have finished",
                param="reset_running_requests",
            )
        if reset_external:
            raise OpenAIError(
                "reset_external=true is not supported: kvllm has no external (connector) prefix cache",
                param="reset_external",
            )
        check_serving()
        if not await llm.reset_prefix_cache():
            raise OpenAIError(
                f"The prefix cache was not reset: {llm.num_in_flight} request(s) hold KV blocks; retry when "
                "they have finished",
                409,
            )
        logger.info("Prefix cache reset")
        return Response(status_code=200)

    @app.get("/v1/models", responses=error_responses(*auth))
    async def list_models() -> ModelList:
        root = llm.engine.model_config.model_path
        return ModelList(data=[ModelCard(id=n, root=root, max_model_len=llm.max_model_len) for n in names])

    @app.get("/health", responses=error_responses(503))
    async def health() -> Response:
        if llm.errored:
            return error_response(f"The engine has stopped after an error: {llm.dead_error!r}", 503)
        if not llm.is_accepting:
            return error_response("The server is shutting down", 503)
        return Response(status_code=200)

    async def ping() -> Response:
        """SageMaker's health check (GET or POST): the answer of /health."""
        return await health()

    for method in ("GET", "POST"):
        app.add_api_route(
            "/ping",
            ping,
            methods=[method],
            operation_id=f"ping_{method.lower()}",
            responses=error_responses(503),
        )

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's route: the requests on the engine's routes being served (0 unless the server was started
        with --enable-server-load-tracking)."""
        return {"server_load": app.state.server_load}

    @app.get("/version")
    async def version() -> dict[str, str]:
        from kvllm import __version__

        return {"version": __version__}

    @app.post("/tokenize", response_model=None, responses=text_errors)
    async def tokenize(body: TokenizeRequest, raw: Request) -> Any:
        return await _until_disconnect(raw, tokenization.tokenize(body))

    @app.post("/detokenize", response_model=None, responses=text_errors)
    async def detokenize(body: DetokenizeRequest, raw: Request) -> Any:
        return await _until_disconnect(raw, tokenization.detokenize(body))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


_CONFLICT = {"model": ErrorResponse, "description": "Requests hold KV blocks: the cache was not reset"}


async def _json_object(raw: Request) -> dict[str, Any]:
    try:
        body = json.loads(await raw.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise OpenAIError(f"The request body must be a JSON object, not {type(body).__name__}")
    return body


def _validated(model: type[T], body: dict[str, Any]) -> T:
    """`body` as `model`, or the 400 a route with that body type answers for it."""
    try:
        return model.model_validate(body)  # type: ignore[attr-defined]
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def _as_response(result: Any) -> Any:
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream")
    return result


async def _until_disconnect(raw: Request, handler: Awaitable[T]) -> T | Response:
    """Run `handler`, cancelling it (which aborts its requests) if the client disconnects first.

    Streams watch for disconnects themselves (Starlette cancels them); this covers the wait for a
    non-streaming response and for the first output.
    """
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    # The client left first: let the handler's cancellation run (it aborts the engine requests).
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is not None:
        logger.debug("%s %s failed after its client left: %r", raw.method, raw.url.path, task.exception())
    logger.info(
        "Client disconnected before the response to %s %s; its requests were aborted",
        raw.method,
        raw.url.path,
    )
    return Response(status_code=499)  # nobody reads this


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class _GracefulServer(uvicorn.Server):
    """uvicorn with kvllm's drain on the first SIGINT/SIGTERM (see the module docstring)."""

    def __init__(
        self,
        config: uvicorn.Config,
        llm: AsyncLLM,
        in_flight: InFlightRequests,
        shutdown_timeout: float,
        keep_alive_on_engine_death: bool,
    ) -> None:
        super().__init__(config)
        self.llm = llm
        self.in_flight = in_flight
        self.shutdown_timeout = shutdown_timeout
        self.keep_alive_on_engine_death = keep_alive_on_engine_death
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False
        self._drain_task: asyncio.Task[None] | None = None
        self._death_watch: asyncio.Task[None] | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        self._death_watch = asyncio.ensure_future(self._exit_when_the_engine_dies())

    async def _exit_when_the_engine_dies(self) -> None:
        error = await self.llm.wait_dead()
        if self.keep_alive_on_engine_death:
            logger.error(
                "The engine has stopped after an error (%r); keeping the server up (keep-alive on engine "
                "death): every request gets 503 until it is stopped",
                error,
            )
            return
        logger.error(
            "The engine has stopped after an error (%r): /health answers 503; exiting with code 1 once "
            "the %d request(s) in flight are answered (at most %.1f s)",
            error,
            self.in_flight.count,
            self.shutdown_timeout,
        )
        await self.in_flight.wait_idle(self.shutdown_timeout)
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Signals are not re-raised after the drain (uvicorn would), so a drained server exits with 0.
        if self._signalled or self._loop is None:
            self.should_exit = True
            self.force_exit = self._signalled
            return
        self._signalled = True
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, name: str) -> None:
        logger.info(
            "Received %s: taking no new requests, giving %d in-flight request(s) up to %.1f s to finish",
            name,
            self.llm.num_in_flight,
            self.shutdown_timeout,
        )
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.llm.drain(self.shutdown_timeout)
            # Aborted streams still have to send their last chunk and [DONE].
            await self.llm.wait_idle(_FLUSH_TIMEOUT)
        finally:
            self.should_exit = True


_FLUSH_TIMEOUT = 2.0  # s for aborted requests to deliver their final response after the grace period
_UVICORN_GRACEFUL_TIMEOUT = 3  # s uvicorn waits for connections after the drain before cancelling them


ALL_INTERFACES = "0.0.0.0"


def bind_warning(host: str | None, api_key: str | Sequence[str] | None) -> str | None:
    """The start-up warning for a server others can reach with no API key, or None."""
    if api_key:
        return None
    try:
        if host is not None and ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        if host == "localhost":
            return None
    where = "all interfaces" if host in (None, "", ALL_INTERFACES, "::") else host
    return (
        f"Listening on {where} with no API key: anyone who can reach this port can generate text and reset "
        "the prefix cache. Set --api-key (or VLLM_API_KEY / KVLLM_API_KEY), or --host 127.0.0.1 to serve "
        "this machine only"
    )


def run_server(
    engine_args: EngineArgs,
    *,
    host: str | None = None,
    port: int = 8000,
    api_key: str | Sequence[str] | None = None,
    served_model_name: Sequence[str] | None = None,
    shutdown_timeout: float = 5.0,
    log_stats_interval: float = 10.0,
    uvicorn_log_level: str = "info",
    access_log: bool = True,
    limits: ServingLimits | None = None,
    keep_alive_on_engine_death: bool = False,
    http: HttpOptions | None = None,
    chat_defaults: ChatTemplateDefaults | None = None,
    response_options: ResponseOptions | None = None,
    request_logger: RequestLogger | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM or engine death; returns the exit code (1 after engine death).

    `host` None listens on all IPv4 interfaces, as vLLM does (its reason: a server in a container or
    behind SageMaker must be reachable from outside); a warning is logged when no API key is set.
    Exits within shutdown_timeout + ~6 s of the signal, or of the engine's death.
    """
    app = build_app(
        engine_args,
        served_model_name=served_model_name,
        api_key=api_key,
        log_stats_interval=log_stats_interval,
        limits=limits,
        chat_defaults=chat_defaults,
        response_options=response_options,
        request_logger=request_logger,
    )
    llm: AsyncLLM = app.state.llm
    host = ALL_INTERFACES if host is None else host
    http = http or HttpOptions()
    http_options.apply_to_app(app, http)
    config = http_options.uvicorn_config(
        app,
        http,
        host=host,
        port=port,
        log_level=uvicorn_log_level,
        access_log=access_log,
        timeout_graceful_shutdown=_UVICORN_GRACEFUL_TIMEOUT,
        timeout_keep_alive=5,
    )
    engine = llm.engine
    display_host = f"[{host}]" if ":" in host else host
    logger.info(
        "Serving model %r as %s (max_model_len=%d, attention backend %s)",
        engine.model_config.model,
        ", ".join(repr(n) for n in app.state.served_model_names),
        engine.model_config.max_model_len,
        engine.attention_backend_name,
    )
    logger.info("Available routes: %s", ", ".join(sorted({getattr(r, "path", "") for r in app.routes})))
    scheme = "https" if http.ssl_certfile else "http"
    logger.info(
        "Starting kvllm API server on %s%s%s",
        f"{scheme}://{display_host}:{port}" if not http.uds else f"unix socket {http.uds} ({scheme})",
        http.root_path,
        " (API key required for /v1/*)" if api_key else "",
    )
    warning = bind_warning(host, api_key)
    if warning is not None:
        logger.warning(warning)
    server = _GracefulServer(config, llm, app.state.in_flight, shutdown_timeout, keep_alive_on_engine_death)
    server.run()
    if llm.errored:
        logger.error("Server stopped after its engine failed: exit code 1")
        return 1
    if server.started:
        logger.info("Server stopped")
        return 0
    return 1
