"""Fixtures shared by the attention-selection and CLI tests (imported by name: no conftest clash)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvllm.attention import registry
from kvllm.attention.selector import clear_selection_cache
from kvllm.config.backend_names import backend_table


@pytest.fixture
def kvllm_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog that sees kvllm's records (the "kvllm" logger does not propagate to the root)."""
    logger = logging.getLogger("kvllm")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="kvllm")
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


@pytest.fixture
def isolated_registry() -> Iterator[None]:
    """Restore the registry (and forget cached choices) after a test that changes it."""
    table = dict(backend_table())
    classes = dict(registry._classes)
    clear_selection_cache()
    try:
        yield
    finally:
        backend_table().clear()
        backend_table().update(table)
        registry._classes.clear()
        registry._classes.update(classes)
        registry._generation += 1
        clear_selection_cache()


def install_backend(name: str, cls: type) -> None:
    """Register an in-test backend class under `name` (use with isolated_registry)."""
    table = backend_table()
    table[name] = f"{cls.__module__}:{cls.__qualname__}"
    registry._classes[name] = cls
    registry._generation += 1
