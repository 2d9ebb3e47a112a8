"""Piecewise CUDA graphs for the steps decode graphs do not cover: prefills, mixed batches, verification.

An eager step of a small model is host-bound: Python launches ~10 kernels per layer at tens of
microseconds each (a 32-token prefill of Qwen3-0.6B took 22.6 ms on an H200 host for ~1 ms of GPU
work). A whole-step graph cannot hold such steps, since attention's launches depend on how the
step's tokens split into requests; but between two attention calls every op works row by row on
the step's tokens, so its launches depend on the token count alone. This runner captures, for each
token-count bucket T, the forward pass cut at every attention call into graph pieces. A step of
t <= T tokens replays piece 0, runs attention 0 eagerly on the step's own metadata, replays piece 1,
and so on: one attention call per layer from Python instead of the whole layer.

What crosses a cut sits at a fixed address. Inside each piece (so as part of the graph) the query,
key and value are copied into buffers shared by every layer and bucket; attention writes into a shared
output buffer that the next piece reads. Where the model's fused RoPE kernel stores K/V itself it also
writes the query straight into the shared buffer (`Attention.query_target`), and key and value are not
copied when the backend then reads only the cache (`AttentionImpl.reads_written_kv`): for TRITON_ATTN
nothing is copied. Tokens t..T-1 are padding: their ids and positions are whatever the input buffers
hold (always in range), their rows are computed and ignored, and attention, which runs on the t real
tokens, never reads or writes them. Where the model stores K/V
itself (the fused RoPE kernel, `Attention.kv_write_target`), the store is part of a piece: it reads
the slot mapping from the input batch's fixed buffer, whose padding rows the runner sets to -1 (write
nothing) before replaying. The pieces of all buckets share one memory pool, and each bucket's pieces replay in the order they were captured, so what one piece leaves for
the next is never overwritten in between.

`graph_factory` makes `torch.cuda.CUDAGraph`s on a GPU. Without one (tests on the CPU) the runner
keeps the same hook and buffers but "replays" by running the forward pass again with the hook
calling attention: everything but the capture itself runs.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvllm.attention.metadata import CommonAttentionMetadata
from kvllm.forward_context import set_forward_context

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Token-count buckets: a step pads to the smallest that holds it (at most 2x its tokens, 1.5x above 2048).
# They reach 8192, the default max_num_batched_tokens: a full prompt chunk run eagerly was host-bound on an
# H200 (22-50 ms per 8192-token mixed step of Qwen3-0.6B, by the host's speed, for ~16 ms of GPU work).
DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192)


def piecewise_token_cap() -> int:
    """The largest bucket captured: KVLLM_PIECEWISE_MAX_TOKENS (a measurement switch), else 8192."""
    value = os.environ.get("KVLLM_PIECEWISE_MAX_TOKENS", str(DEFAULT_TOKEN_BUCKETS[-1]))
    if not value.isdigit():
        raise ValueError(f"KVLLM_PIECEWISE_MAX_TOKENS={value!r}: expected a number of tokens")
    return int(value)


def default_token_buckets(max_num_tokens: int, cap: int | None = None) -> list[int]:
    """The buckets up to min(cap, max_num_tokens); [] when even the smallest does not fit."""
    cap = piecewise_token_cap() if cap is None else cap
    return [t for t in DEFAULT_TOKEN_BUCKETS if t <= min(cap, max_num_tokens)]


@dataclass
class _Call:
    """One attention call of a captured forward: the layer and the fixed-address views it reads/writes."""

    layer: Any
    query: torch.Tensor  # [T, H, D] view of the shared query buffer
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor  # [T, H, D] view of the shared output buffer
    kv_written: bool  # the piece before stored K/V (the eager call must not store them again)


@dataclass
class _Bucket:
    pieces: list[Any] = field(default_factory=list)  # graphs; len(calls) + 1 of them
    calls: list[_Call] = field(default_factory=list)
    # Without graphs: the capture's metadata, which the forward pass sees between the attention calls as
    # the pieces saw it (its slot mapping is the fixed buffer's first T rows, for K/V stored by the model).
    capture_metadata: Any = None
    hidden: torch.Tensor | None = None  # the last piece's output


class _SharedBuffers:
    """Query/key/value/output buffers of the largest bucket, one set per (heads, head size, dtype)."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.device = device
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, role: str, like: torch.Tensor) -> torch.Tensor:
        """A [T, heads, head_size] view of the buffer for `role`, T = like.shape[0]."""
        num_tokens, heads, head_size = like.shape
        return self.view(role, num_tokens, heads, head_size, like.dtype)

    def view(
        self, role: str, num_tokens: int, heads: int, head_size: int, dtype: torch.dtype
    ) -> torch.Tensor:
        key = (role, heads, head_size, dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = torch.zeros((self.max_tokens, heads, head_size), dtype=dtype, device=self.device)
            self._buffers[key] = buffer
        return buffer[:num_tokens]


class PiecewiseGraphRunner:
    """Captures `forward(input_ids[:T], positions[:T])` in pieces for each bucket T (see the module
    docstring) and replays a step of t <= T tokens through them.

    `make_capture_metadata(T)` returns a CommonAttentionMetadata of T tokens that writes no KV (slot
    -1), for the warm-up run before each capture; `builder` turns it (and each replayed step's
    metadata) into the backend's metadata. `slot_mapping` is the fixed buffer every step's slots are
    uploaded to (the capture metadata's and the steps' slot mappings are views of it).
    """

    def __init__(
        self,
        forward: Forward,
        builder: Any,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        buckets: list[int],
        make_capture_metadata: Callable[[int], CommonAttentionMetadata],
        graph_factory: Callable[[], Any] | None = None,
    ) -> None:
        if not buckets or sorted(set(buckets)) != sorted(buckets) or min(buckets) < 1:
            raise ValueError(f"buckets must be distinct positive token counts, got {buckets}")
        if max(buckets) > min(input_ids.shape[0], positions.shape[0], slot_mapping.shape[0]):
            raise ValueError(
                f"the largest bucket {max(buckets)} exceeds the input buffers ({input_ids.shape[0]})"
            )
        self.forward = forward
        self.builder = builder
        self.input_ids = input_ids
        self.positions = positions
        self.slot_mapping = slot_mapping
        self.buckets = sorted(buckets)
        self.make_capture_metadata = make_capture_metadata
        self.device = input_ids.device
        if graph_factory is None and self.device.type == "cuda":
            graph_factory = torch.cuda.CUDAGraph
        self.graph_factory = graph_factory
        self.pool = torch.cuda.graph_pool_handle() if graph_factory is not None else None
        self.stream = torch.cuda.Stream(self.device) if graph_factory is not None else None
        self.shared = _SharedBuffers(self.buckets[-1], self.device)
        self.captured: dict[int, _Bucket] = {}
        self.num_replays = 0
        self._writes_output: dict[type, bool] = {}

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_tokens: int) -> int | None:
        for bucket in self.buckets:
            if bucket >= num_tokens:
                return bucket
        return None

    # ---- capture -----------------------------------------------------------------------------

    def capture(self) -> float:
        """Capture every bucket, largest first (smaller ones reuse its pool blocks); returns seconds."""
        start = time.perf_counter()
        for bucket in reversed(self.buckets):
            self.captured[bucket] = self._capture_one(bucket)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def _capture_one(self, size: int) -> _Bucket:
        attn_metadata = self.builder.build(self.make_capture_metadata(size))
        ids, pos = self.input_ids[:size], self.positions[:size]
        # Warm-up outside any graph: Triton compiles and libraries plan on first use.
        with set_forward_context(attn_metadata):
            self.forward(ids, pos)
        bucket = _Bucket()
        if self.graph_factory is None:
            self._record_calls(bucket, ids, pos, attn_metadata)
            bucket.capture_metadata = attn_metadata
            return bucket
        torch.cuda.synchronize(self.device)
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            graph = self._begin()

            def cut(
                layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_written: bool
            ) -> torch.Tensor:
                nonlocal graph
                call = self._stage(layer, q, k, v, kv_written)
                graph.capture_end()
                bucket.pieces.append(graph)
                bucket.calls.append(call)
                graph = self._begin()
                return call.output

            try:
                with set_forward_context(attn_metadata, attention_hook=cut, query_buffer=self._query_buffer):
                    bucket.hidden = self.forward(ids, pos)
            except BaseException:
                # End the open capture so the stream can run again, then report the first error.
                try:
                    graph.capture_end()
                except RuntimeError:
                    pass
                raise
            graph.capture_end()
            bucket.pieces.append(graph)
        return bucket

    def _begin(self) -> Any:
        graph = self.graph_factory()
        graph.capture_begin(pool=self.pool)
        return graph

    def _stage(
        self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_written: bool
    ) -> _Call:
        """Copy the attention inputs into the shared buffers (inside the piece being captured). K and V
        stay out when the layer stored them already and its backend reads only the cache then (for an
        8,192-token step of Qwen3-0.6B, 28 x 33.5 MB not copied): the call gets the buffers as they are."""
        call = _Call(
            layer,
            self.shared.get("query", q),
            self.shared.get("key", k),
            self.shared.get("value", v),
            self.shared.get("output", q),
            kv_written,
        )
        if not _same_view(q, call.query):  # a layer that wrote q into the buffer (query_target) needs no copy
            call.query.copy_(q)
        reads_written_kv = getattr(getattr(layer, "impl", None), "reads_written_kv", None)
        if not kv_written or reads_written_kv is None or reads_written_kv():
            call.key.copy_(k)
            call.value.copy_(v)
        return call

    def _query_buffer(self, layer: Any, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """The shared query buffer as a [T, H * D] view, for a layer that writes its query there itself."""
        view = self.shared.view("query", num_tokens, layer.num_heads, layer.head_size, dtype)
        return view.view(num_tokens, layer.num_heads * layer.head_size)

    def _record_calls(
        self, bucket: _Bucket, ids: torch.Tensor, pos: torch.Tensor, attn_metadata: Any
    ) -> None:
        def record(
            layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_written: bool
        ) -> torch.Tensor:
            call = self._stage(layer, q, k, v, kv_written)
            bucket.calls.append(call)
            return call.output

        with set_forward_context(attn_metadata, attention_hook=record, query_buffer=self._query_buffer):
            bucket.hidden = self.forward(ids, pos)

    # ---- replay ------------------------------------------------------------------------------

    def can_replay(self, num_tokens: int) -> bool:
        return 0 < num_tokens and self.bucket_for(num_tokens) in self.captured

    def replay(self, common: CommonAttentionMetadata, num_tokens: int) -> torch.Tensor:
        """Run a step of `num_tokens` tokens (inputs already in the buffers, `common` its metadata)
        through its bucket's pieces; returns the hidden states of its tokens."""
        size = self.bucket_for(num_tokens)
        if size is None or size not in self.captured:
            raise ValueError(
                f"no piecewise graphs for {num_tokens} tokens; captured: {sorted(self.captured)}"
            )
        bucket = self.captured[size]
        self.slot_mapping[num_tokens:size].fill_(-1)  # the padding rows' K/V stores write nothing
        attn_metadata = self.builder.build(common)
        if self.graph_factory is None:
            self._run_without_graphs(bucket, size, attn_metadata, num_tokens)
        else:
            for piece, call in zip(bucket.pieces, bucket.calls):
                piece.replay()
                self._attend(call, attn_metadata, num_tokens)
            bucket.pieces[-1].replay()
        self.num_replays += 1
        assert bucket.hidden is not None
        return bucket.hidden[:num_tokens]

    def _run_without_graphs(self, bucket: _Bucket, size: int, attn_metadata: Any, num_tokens: int) -> None:
        calls = iter(bucket.calls)

        def attend(
            layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_written: bool
        ) -> torch.Tensor:
            call = next(calls)
            if call.layer is not layer or call.kv_written != kv_written:
                raise RuntimeError(
                    "the forward pass called attention layers in another order than at capture"
                )
            call = self._stage(layer, q, k, v, kv_written)
            self._attend(call, attn_metadata, num_tokens)
            return call.output

        with set_forward_context(
            bucket.capture_metadata, attention_hook=attend, query_buffer=self._query_buffer
        ):
            bucket.hidden = self.forward(self.input_ids[:size], self.positions[:size])

    def _attend(self, call: _Call, attn_metadata: Any, n: int) -> None:
        layer = call.layer
        impl = layer.impl
        out = call.output[:n]
        args = (layer, call.query[:n], call.key[:n], call.value[:n], layer.kv_cache, attn_metadata)
        kwargs = {"kv_written": True} if call.kv_written else {}
        if self._takes_output(impl):
            result = impl.forward(*args, output=out, **kwargs)
            if result.data_ptr() != out.data_ptr():
                out.copy_(result)
        else:
            out.copy_(impl.forward(*args, **kwargs))

    def _takes_output(self, impl: Any) -> bool:
        kind = type(impl)
        known = self._writes_output.get(kind)
        if known is None:
            known = "output" in inspect.signature(impl.forward).parameters
            self._writes_output[kind] = known
        return known


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )
