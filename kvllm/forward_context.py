"""The per-step forward context: attention metadata visible to every attention layer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    attn_metadata: Any  # None during profiling / dummy runs: layers then attend within the batch only
    # Set by the piecewise CUDA-graph runner: attention layers hand (layer, q, k, v, kv_written) to it instead of
    # calling their backend, and take its [T, H, D] result (kvllm/worker/piecewise_graph.py).
    attention_hook: Callable[..., Any] | None = None
    # Set with attention_hook: (layer, num_tokens, dtype) -> the [T, H * D] buffer the hook reads the layer's
    # query from, for a layer that can write its query there directly (Attention.query_target).
    query_buffer: Callable[..., Any] | None = None


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(
    attn_metadata: Any,
    attention_hook: Callable[..., Any] | None = None,
    query_buffer: Callable[..., Any] | None = None,
) -> Iterator[ForwardContext]:
    """Enter the context for one forward pass; nesting is a bug and is refused."""
    global _current
    if _current is not None:
        raise RuntimeError("forward context is already set: nested forward passes are not supported")
    _current = ForwardContext(
        attn_metadata=attn_metadata, attention_hook=attention_hook, query_buffer=query_buffer
    )
    try:
        yield _current
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: model forward must run inside set_forward_context()")
    return _current
