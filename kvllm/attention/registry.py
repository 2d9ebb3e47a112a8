"""Registry from backend names to lazily imported backend classes.

A backend is registered as a `"module:Class"` path and imported only when first asked for, so
listing names never imports a kernel library. The table of names (built-in backends whose module
exists in this build, plus out-of-tree ones added with `register_backend`) is vocabulary and lives
at the ground floor, in `kvllm.config.backend_names`; this module imports and checks the classes.
"""

from __future__ import annotations

import importlib
import re

from kvllm.attention.backend import AttentionBackend
from kvllm.config.backend_names import (
    backend_table,
    is_registered,
    registered_backend_names,
    unknown_backend_error,
)

__all__ = [
    "backend_path",
    "generation",
    "get_backend_class",
    "is_registered",
    "register_backend",
    "registered_backend_names",
    "unregister_backend",
]

_NAME_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")
_PATH_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

_classes: dict[str, type[AttentionBackend]] = {}
_generation = 0  # bumped on every change, so cached selections can tell they are stale


def backend_path(name: str) -> str:
    """The `"module:Class"` path a registered backend is loaded from."""
    _check_known(str(name))
    return backend_table()[str(name)]


def generation() -> int:
    """A counter that changes whenever the registry changes (part of selection cache keys)."""
    return _generation


def register_backend(name: str, class_path: str) -> None:
    """Register an out-of-tree backend, e.g. `register_backend("MY_ATTN", "my_pkg.attn:MyBackend")`.

    The class is imported on first use and must subclass AttentionBackend. Names are upper-case
    identifiers; registering a name twice is an error (unregister it first).
    """
    global _generation
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"Invalid attention backend name {name!r}: use an upper-case identifier such as 'MY_ATTN'"
        )
    if not isinstance(class_path, str) or not _PATH_RE.match(class_path):
        raise ValueError(
            f"Invalid class path {class_path!r} for attention backend {name}: use 'package.module:ClassName'"
        )
    table = backend_table()
    if name in table:
        raise ValueError(
            f"Attention backend {name} is already registered (as {table[name]}); "
            "choose another name or call unregister_backend first"
        )
    table[name] = class_path
    _generation += 1


def unregister_backend(name: str) -> None:
    """Remove a registered backend (meant for out-of-tree backends and tests)."""
    global _generation
    _check_known(str(name))
    del backend_table()[str(name)]
    _classes.pop(str(name), None)
    _generation += 1


def get_backend_class(name: str) -> type[AttentionBackend]:
    """Import (once) and return the class of a registered backend.

    Raises ValueError for unknown names and ImportError, naming the module, when the
    declarations cannot be imported.
    """
    key = str(name)
    _check_known(key)
    if key not in _classes:
        module_name, _, class_name = backend_table()[key].partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ImportError(f"attention backend {key}: cannot import {module_name}: {exc}") from exc
        cls = getattr(module, class_name, None)
        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            raise ImportError(
                f"attention backend {key}: {module_name}.{class_name} is not an AttentionBackend subclass"
            )
        _classes[key] = cls
    return _classes[key]


def _check_known(name: str) -> None:
    if name not in backend_table():
        raise unknown_backend_error(name)
