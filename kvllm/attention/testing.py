"""One harness for attention backends: build a random paged batch, fill the cache, run a backend
through its metadata builder and implementation, compare with the float32 reference.

The declared-equals-implemented walk, the kernel and GPU tests of every backend and `kvllm bench
attention` all run backends through here, so they exercise the contract the model runner uses.
Nothing here is backend-specific: the cache is filled through views found from the backend's own
`get_kv_cache_shape`, and the layer is the AttentionLayer protocol (the fp8 scales).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kvllm.attention.backend import AttentionBackend
from kvllm.attention.impl import AttentionImpl, AttentionMetadataBuilder
from kvllm.attention.metadata import KVCacheSpec
from kvllm.attention.reference import PagedBatch, make_paged_batch, reference_attention
from kvllm.utils.dtypes import cache_torch_dtype_is_fp8, kv_cache_torch_dtype

SHARD_ENV = "KVLLM_GPU_SHARD"
# Distinct sizes (none of them 2) to read a layout off get_kv_cache_shape.
_PROBE = {"blocks": 11, "block_size": 13, "kv_heads": 5, "head_size": 7}

Case = TypeVar("Case")


@dataclass
class ScaledLayer:
    """The AttentionLayer an implementation reads: fp8 scales as float32 scalars on the device."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor

    @classmethod
    def of(cls, k_scale: float, v_scale: float, device: torch.device) -> ScaledLayer:
        return cls(
            torch.tensor(k_scale, dtype=torch.float32, device=device),
            torch.tensor(v_scale, dtype=torch.float32, device=device),
        )


# ---- what a cache holds -------------------------------------------------------------------------


def fp8_quantize(x: torch.Tensor, fp8_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What the KV write stores for x: the IEEE float32 quotient x / scale, rounded to nearest even fp8.

    Divides by a float32 tensor on x's device: on a CUDA tensor, torch turns division by a Python
    float into a multiplication by its reciprocal, which rounds differently in the last bit.
    """
    return (x.float() / torch.tensor(scale, dtype=torch.float32, device=x.device)).to(fp8_dtype)


def stored(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a cache of `cache_dtype` stores it (an fp8 cache: x / scale)."""
    if cache_torch_dtype_is_fp8(cache_dtype):
        return fp8_quantize(x, cache_dtype, scale)
    return x.to(cache_dtype)


def dequantized(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a cache of `cache_dtype` gives it back, in float32 (an fp8 cache: times scale)."""
    if cache_torch_dtype_is_fp8(cache_dtype):
        return fp8_quantize(x, cache_dtype, scale).float() * scale
    return x.to(cache_dtype).float()


def kv_cache_views(
    backend: type[AttentionBackend], kv_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache) as [num_blocks, block_size, num_kv_heads, head_size] views of kv_cache.

    The layout is read off the backend's own `get_kv_cache_shape` with distinct probe sizes, so any
    5-d layout that permutes (K/V axis, blocks, block_size, kv_heads, head_size) works: the K/V axis
    is where the 2 lands, the other axes are permuted back to NHD pages. Writes through the views
    land in kv_cache. Raises ValueError for a layout outside that family.
    """
    p = _PROBE
    probe = tuple(backend.get_kv_cache_shape(p["blocks"], p["block_size"], p["kv_heads"], p["head_size"]))
    wanted = (p["blocks"], p["block_size"], p["kv_heads"], p["head_size"])
    if len(probe) != 5 or sorted(probe) != sorted((2, *wanted)):
        raise ValueError(
            f"KV cache shape {probe} for (blocks, block_size, kv_heads, head_size)={wanted} is not a "
            "permutation of (2, blocks, block_size, kv_heads, head_size)"
        )
    kv_axis = probe.index(2)
    rest = [size for axis, size in enumerate(probe) if axis != kv_axis]
    order = [rest.index(size) for size in wanted]
    return kv_cache.select(kv_axis, 0).permute(order), kv_cache.select(kv_axis, 1).permute(order)


def fill_cache(
    batch: PagedBatch,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    poison_unused_pages: bool = False,
) -> None:
    """Write the cached context (not the step's new tokens) into NHD views, as the KV write stores it.

    With `poison_unused_pages`, pages no request reads hold NaN (reading past a sequence shows up
    as NaN) and the pages requests own start at zero, as in a zeroed cache.
    """
    if poison_unused_pages:
        key_cache.fill_(float("nan"))
        value_cache.fill_(float("nan"))
        for r, seq_len in enumerate(batch.seq_lens):
            used = batch.block_table[r, : -(-seq_len // batch.block_size)].long()
            key_cache[used] = 0.0
            value_cache[used] = 0.0
    for blocks, offsets, k, v in batch.cached_context():
        key_cache[blocks, offsets] = stored(k, key_cache.dtype, k_scale)
        value_cache[blocks, offsets] = stored(v, value_cache.dtype, v_scale)


def read_back(batch: PagedBatch, key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: float = 1.0,
              v_scale: float = 1.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
    """Every request's whole context [seq_len, Hkv, D] as the cache holds it, dequantized, in float32."""
    keys, values = [], []
    for r, seq_len in enumerate(batch.seq_lens):
        blocks, offsets = batch.pages(r, torch.arange(seq_len, device=key_cache.device))
        keys.append(key_cache[blocks, offsets].float() * k_scale)
        values.append(value_cache[blocks, offsets].float() * v_scale)
    return keys, values


def check_read_back(stored: list[torch.Tensor], original: list[torch.Tensor], fp8_dtype: torch.dtype | None,
                    scale: float, what: str) -> None:  # fmt: skip
    """The cache holds every context row (the KV write's new rows too) up to one rounding to its dtype.

    Exact for a model-dtype cache; for fp8, half an ulp of x / scale (eps / 2 relative, or half the
    smallest subnormal step), times scale. Catches rows written to the wrong slot or not at all.
    """
    for r, (got, want) in enumerate(zip(stored, original)):
        want = want.float()
        if fp8_dtype is None:
            bad = got != want
        else:
            info = torch.finfo(fp8_dtype)
            bound = torch.clamp(want.abs() * (info.eps / 2), min=scale * info.tiny * info.eps / 2)
            bad = (got - want).abs() > bound * (1 + 1e-5)
        if bad.any():
            pos = int(bad.nonzero()[0, 0])
            raise AssertionError(f"{what} cache of request {r} is wrong at context position {pos}")


# ---- inputs -----------------------------------------------------------------------------------


def random_sinks(num_heads: int, seed: int, device: str | torch.device) -> torch.Tensor:
    """One sink logit per query head, N(0, 2^2), float32."""
    return (torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2).to(device)


def shard(cases: Sequence[Case], group: Callable[[Case], Hashable] | None = None) -> list[Case]:
    """KVLLM_GPU_SHARD=i/n keeps the i-th of every n groups of cases, so n processes share the work.

    A group is every case with the same `group(case)` (e.g. one compile unit); by default each
    case is its own group, so shard i keeps every n-th case.
    """
    spec = os.environ.get(SHARD_ENV)
    if not spec:
        return list(cases)
    index, count = (int(x) for x in spec.split("/"))
    key = group or (lambda case: case)
    groups = list(dict.fromkeys(key(c) for c in cases))
    mine = {g for j, g in enumerate(groups) if j % count == index}
    return [c for c in cases if key(c) in mine]


# ---- running a backend ------------------------------------------------------------------------


def make_impl(
    backend: type[AttentionBackend], num_heads: int, head_size: int, num_kv_heads: int, **features: Any
) -> AttentionImpl:
    """The backend's implementation for one layer (scale head_size ** -0.5); `features` are the
    AttentionImpl keywords: sliding_window, logits_soft_cap, attn_type, kv_cache_dtype, sinks."""
    return backend.get_impl_cls()(num_heads, head_size, head_size**-0.5, num_kv_heads, **features)


def make_builder(
    backend: type[AttentionBackend],
    batch: PagedBatch,
    cache_dtype: torch.dtype,
    kv_cache_dtype: str,
    limits: tuple[int, int, int] | None = None,
) -> AttentionMetadataBuilder:
    """The backend's builder for `batch`; `limits` = (max_num_reqs, max_num_tokens, max_model_len),
    by default the batch's own sizes with one block of room."""
    md = batch.metadata
    kv_heads, head_size = batch.new_keys.shape[1:]
    spec = KVCacheSpec(batch.block_size, kv_heads, head_size, cache_dtype, kv_cache_dtype)
    if limits is None:
        limits = (md.num_reqs, md.num_actual_tokens, md.max_seq_len + batch.block_size)
    return backend.get_builder_cls()(backend, spec, batch.query.device, *limits)


@dataclass
class BackendCase:
    """A backend bound to one paged batch: filled cache, builder, impl and layer, ready to run.

    `query`/`key`/`value` are the step's inputs (the batch's, plus padding rows if asked for);
    `out` and `ref` are set by run_backend_case.
    """

    backend: type[AttentionBackend]
    batch: PagedBatch
    kv_cache: torch.Tensor
    key_cache: torch.Tensor  # NHD view of kv_cache
    value_cache: torch.Tensor
    builder: AttentionMetadataBuilder
    impl: AttentionImpl
    layer: ScaledLayer
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    metadata: Any  # what the builder returned last
    metadata_attrs: dict[str, Any]
    output: torch.Tensor | None = None  # a preallocated output buffer (NaN), for impls that take one
    out: torch.Tensor | None = None
    ref: torch.Tensor | None = None

    def build(self) -> Any:
        metadata = self.builder.build(self.batch.metadata)
        for name, value in self.metadata_attrs.items():
            setattr(metadata, name, value)
        return metadata

    def forward(self) -> torch.Tensor:
        """One layer's forward on the current metadata (the step's KV write included)."""
        extra = {} if self.output is None else {"output": self.output}
        return self.impl.forward(
            self.layer, self.query, self.key, self.value, self.kv_cache, self.metadata, **extra
        )

    def first_layer(self) -> torch.Tensor:
        """build() then forward on the fresh metadata: what the first layer of a step waits for."""
        self.metadata = self.build()
        return self.forward()

    @property
    def num_tokens(self) -> int:
        return self.batch.metadata.num_actual_tokens

    def written_keys(self) -> torch.Tensor:
        """The cache rows at the step's slots: the new keys as the KV write stored them."""
        slots = self.batch.metadata.slot_mapping[: self.num_tokens]
        return self.key_cache[slots // self.batch.block_size, slots % self.batch.block_size]

    def rel_error(self) -> float:
        """Relative L2 error of the output (real tokens) against the reference."""
        out = self.out[: self.num_tokens].float()
        return ((out - self.ref).norm() / self.ref.norm()).item()

    def max_abs_error(self) -> float:
        return (self.out[: self.num_tokens].float() - self.ref).abs().max().item()

    def rel_max_error(self) -> float:
        """Largest absolute error over the largest absolute reference value."""
        out = self.out[: self.num_tokens].float()
        return ((out - self.ref).abs().max() / self.ref.abs().max()).item()


def prepare_backend_case(
    backend: type[AttentionBackend],
    batch: PagedBatch,
    *,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    attn_type: str = "decoder",
    poison_unused_pages: bool = False,
    pad_tokens: int = 0,
    builder_limits: tuple[int, int, int] | None = None,
    impl_attrs: dict[str, Any] | None = None,
    metadata_attrs: dict[str, Any] | None = None,
    preallocated_output: bool = False,
) -> BackendCase:
    """Allocate the backend's cache, write the batch's context, build the step's metadata once.

    `pad_tokens` appends random query/key/value rows with slot -1 (CUDA-graph padding);
    `impl_attrs` / `metadata_attrs` override attributes after construction / after each build.
    """
    device = batch.query.device
    num_heads, head_size = batch.query.shape[1:]
    num_kv_heads = batch.new_keys.shape[1]
    cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, batch.query.dtype)
    kv_cache = backend.allocate_kv_cache(
        batch.num_blocks, batch.block_size, num_kv_heads, head_size, cache_dtype, device
    )
    key_cache, value_cache = kv_cache_views(backend, kv_cache)
    fill_cache(batch, key_cache, value_cache, k_scale, v_scale, poison_unused_pages)
    impl = make_impl(backend, num_heads, head_size, num_kv_heads, sliding_window=sliding_window,
                     logits_soft_cap=logits_soft_cap, attn_type=attn_type, kv_cache_dtype=kv_cache_dtype,
                     sinks=sinks)  # fmt: skip
    for name, value in (impl_attrs or {}).items():
        setattr(impl, name, value)
    query, key, value = batch.query, batch.new_keys, batch.new_values
    if pad_tokens:
        query, key, value = (torch.cat([t, torch.randn_like(t[:pad_tokens])]) for t in (query, key, value))
        pad_slots = torch.full((pad_tokens,), -1, device=device)
        batch.metadata.slot_mapping = torch.cat([batch.metadata.slot_mapping, pad_slots])
    case = BackendCase(
        backend=backend,
        batch=batch,
        kv_cache=kv_cache,
        key_cache=key_cache,
        value_cache=value_cache,
        builder=make_builder(backend, batch, cache_dtype, kv_cache_dtype, builder_limits),
        impl=impl,
        layer=ScaledLayer.of(k_scale, v_scale, device),
        query=query,
        key=key,
        value=value,
        metadata=None,
        metadata_attrs=dict(metadata_attrs or {}),
        output=torch.full_like(query, float("nan")) if preallocated_output else None,
    )
    case.metadata = case.build()
    return case


def run_backend_case(
    backend: type[AttentionBackend],
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    *,
    seed: int = 0,
    causal: bool = True,
    steps: int = 1,
    reference: str = "inputs",
    **options: Any,
) -> BackendCase:
    """Run `steps` forward passes of `backend` over a random paged batch and compute the reference.

    `options` go to prepare_backend_case. The reference attends in float32 over what the cache
    should hold: with reference="inputs", the batch's K/V rounded to the cache dtype (fp8: stored
    as value / scale, read back times scale); with reference="cache", what the cache does hold
    after the step, after checking every row against the inputs (check_read_back).
    """
    batch = make_paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_size, block_size,
                             dtype=dtype, device=device, seed=seed)  # fmt: skip
    batch.metadata.causal = causal
    case = prepare_backend_case(backend, batch, **options)
    # Later steps rebuild the metadata and rewrite the same slots.
    case.out = case.forward()
    for _ in range(steps - 1):
        case.out = case.first_layer()
    k_scale, v_scale = options.get("k_scale", 1.0), options.get("v_scale", 1.0)
    cache_dtype = case.kv_cache.dtype
    if options.get("attn_type") == "encoder_only":  # no cache: attends over the inputs as given
        keys, values = batch.keys, batch.values
    elif reference == "inputs":
        keys = [dequantized(k, cache_dtype, k_scale) for k in batch.keys]
        values = [dequantized(v, cache_dtype, v_scale) for v in batch.values]
    elif reference == "cache":
        fp8 = cache_dtype if cache_torch_dtype_is_fp8(cache_dtype) else None
        if fp8 is None:
            k_scale = v_scale = 1.0
        keys, values = read_back(batch, case.key_cache, case.value_cache, k_scale, v_scale)
        check_read_back(keys, batch.keys, fp8, k_scale, "key")
        check_read_back(values, batch.values, fp8, v_scale, "value")
    else:
        raise ValueError(f"reference={reference!r}; allowed: inputs, cache")
    case.ref = reference_attention(
        batch.query,
        keys,
        values,
        batch.query_lens,
        head_size**-0.5,
        causal=causal,
        sliding_window=options.get("sliding_window"),
        logits_soft_cap=options.get("logits_soft_cap"),
        sinks=options.get("sinks"),
    )
    return case


def run_triton_case(
    *shape: Any,
    device: str | torch.device = "cpu",
    use_sinks: bool = False,
    num_splits: int | None = None,
    decode_config: object | None = None,
    prefill_config: object | None = None,
    seed: int = 0,
    **options: Any,
) -> BackendCase:
    """TRITON_ATTN through run_backend_case (`shape`: its query_lens ... dtype), with tile and
    split-KV overrides.

    The output buffer starts as NaN (every real token must be written) and the reference reads
    what the cache holds after the step. `num_splits` forces the decode launch's split-KV segment
    count (None = the builder's choice); sinks are random_sinks(num_heads, seed + 1).
    """
    from kvllm.attention.backends.triton_attn import TritonAttentionBackend

    num_heads = shape[2]
    return run_backend_case(
        TritonAttentionBackend, *shape, device=device, seed=seed, reference="cache", preallocated_output=True,
        sinks=random_sinks(num_heads, seed + 1, device) if use_sinks else None,
        impl_attrs={"decode_config": decode_config, "prefill_config": prefill_config},
        metadata_attrs={} if num_splits is None else {"num_splits": num_splits},
        **options,
    )  # fmt: skip
