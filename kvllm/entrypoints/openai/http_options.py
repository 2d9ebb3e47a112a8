"""HttpOptions applied to the app and to uvicorn: CORS, hidden docs, TLS, unix socket, proxy path,
access-log filter (vLLM's frontend flags; see kvllm.config.serving.HttpOptions)."""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

import uvicorn
from fastapi import FastAPI

from kvllm.config.serving import HttpOptions
from kvllm.logger import init_logger

logger = init_logger(__name__)


def apply_to_app(app: FastAPI, options: HttpOptions) -> None:
    """CORS middleware when asked for; the OpenAPI schema and docs pages removed when asked."""
    if options.cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins or ()),
            allow_credentials=options.allow_credentials,
            allow_methods=list(options.allowed_methods),
            allow_headers=list(options.allowed_headers),
        )
    if options.enable_server_load_tracking:
        from kvllm.entrypoints.openai.middleware import ServerLoadMiddleware

        app.add_middleware(ServerLoadMiddleware, state=app.state)
    if options.enable_request_id_headers:
        from kvllm.entrypoints.openai.middleware import RequestIdHeaderMiddleware

        app.add_middleware(RequestIdHeaderMiddleware)
    for path in options.middleware:
        add_middleware(app, path)
    if options.disable_fastapi_docs:
        hidden = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}
        app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in hidden]
        app.openapi_url = app.docs_url = app.redoc_url = None


def add_middleware(app: FastAPI, path: str) -> None:
    """vLLM's --middleware: import `path` ("module.Name"); a class is added as ASGI middleware, an async
    function as an HTTP middleware (`async def f(request, call_next)`)."""
    imported = resolve_middleware(path)
    if inspect.isclass(imported):
        app.add_middleware(imported)
    else:
        app.middleware("http")(imported)
    logger.info("Added middleware %s", path)


def resolve_middleware(path: str) -> Any:
    """The class or async function `path` names; ValueError saying what is wrong otherwise."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"--middleware {path!r} is not an import path; e.g. my_package.middleware.Timing")
    try:
        imported = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--middleware {path!r} cannot be imported: {exc}") from None
    if not (inspect.isclass(imported) or inspect.iscoroutinefunction(imported)):
        raise ValueError(f"Invalid middleware {path}. Must be a function or a class.")
    return imported


def uvicorn_config(app: FastAPI, options: HttpOptions, **kwargs: Any) -> uvicorn.Config:
    """uvicorn.Config with the socket, TLS and proxy settings of `options` on top of `kwargs`."""
    extra: dict[str, Any] = {"root_path": options.root_path}
    if options.uds:
        extra["uds"] = options.uds
    if options.ssl_certfile:
        extra.update(
            ssl_keyfile=options.ssl_keyfile,
            ssl_certfile=options.ssl_certfile,
            ssl_ca_certs=options.ssl_ca_certs,
            ssl_cert_reqs=options.ssl_cert_reqs,
        )
        if options.ssl_ciphers:
            extra["ssl_ciphers"] = options.ssl_ciphers
    if options.h11_max_incomplete_event_size is not None:
        extra["h11_max_incomplete_event_size"] = options.h11_max_incomplete_event_size
    config = uvicorn.Config(app, **kwargs, **extra)
    # After uvicorn.Config, which (re)configures uvicorn's loggers.
    if options.disable_access_log_for_endpoints:
        logging.getLogger("uvicorn.access").addFilter(
            _EndpointFilter(options.disable_access_log_for_endpoints)
        )
    return config


class _EndpointFilter(logging.Filter):
    """Drops uvicorn access-log lines for the given paths (query strings ignored)."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in self.paths
        return True
