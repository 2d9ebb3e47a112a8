"""FLEX_ATTENTION kernel side: torch.nn.attention.flex_attention over the paged KV cache.

Layout. The kernel's KV "sequence" is the whole physical cache, num_blocks * block_size slots,
viewed (no copy) as [1, num_kv_heads, num_blocks * block_size, head_size]. Query tokens of the
step are one packed sequence, padded to a bucketed length.

Mask. `mask_mod(q, kv)` maps the query row to its request and absolute position, and the
physical slot kv to (physical page, offset) -> logical page via an inverse block table -> logical
position; the slot is visible iff the request's own table holds that page at that logical index,
the position is below the request's seq_len, and the causal / sliding-window rules hold.

Sparsity. The BlockMask is built directly from the block tables with BlockMask.from_kv_blocks:
one KV tile per page, 16 query tokens per query tile, and for each query tile the distinct
pages its requests may read (causal upper bound, sliding-window lower bound). The work is
proportional to (query tiles x pages they read), never to query tokens x cache slots.

Compilation. flex_attention is torch.compile'd with static shapes. Every input shape is fixed
by the cache and the builder's limits except the padded query length, a power of two >= 16, so
a model compiles once per query bucket and per distinct layer configuration (mask rules,
soft-cap, dtype, head counts): at most log2(max tokens per step / 16) + 1 times per
configuration. KVLLM_FLEX_COMPILE=0, or a failed compile, selects eager flex_attention instead;
eager materializes scores, so it attends over a compact copy of the pages the step reads.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kvllm.attention.impl import AttentionImpl, AttentionMetadataBuilder
from kvllm.attention.metadata import CommonAttentionMetadata

if TYPE_CHECKING:
    from kvllm.layers.attention import Attention

logger = logging.getLogger(__name__)

Q_TILE = 16  # query tokens per BlockMask row tile (the smallest tile the GPU kernel runs)
COMPILE_ENV = "KVLLM_FLEX_COMPILE"
# Dynamo's default (8) is below buckets x layer configurations; past it dynamo silently runs
# eager, which on the physical layout materializes query x whole-cache scores.
RECOMPILE_LIMIT = 64

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def query_bucket(num_tokens: int) -> int:
    """Padded query length for the compiled kernel: the next power of two, at least one tile."""
    return max(Q_TILE, 1 << (max(num_tokens, 1) - 1).bit_length())


# ---- compilation state ---------------------------------------------------------------------------

_num_compilations = 0
_compiled_flex: Callable[..., torch.Tensor] | None = None
_compile_failure: str | None = None
_announced: set[str] = set()


def flex_compile_count() -> int:
    """How many graphs torch.compile has built for this backend in this process."""
    return _num_compilations


def _counting_inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    global _num_compilations
    _num_compilations += 1
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def _get_compiled_flex() -> Callable[..., torch.Tensor]:
    global _compiled_flex
    if _compiled_flex is None:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        _compiled_flex = torch.compile(
            flex_attention, backend=_counting_inductor, fullgraph=True, dynamic=False
        )
    return _compiled_flex


def _announce_once(key: str, level: int, message: str, *args: object) -> None:
    if key not in _announced:
        _announced.add(key)
        logger.log(level, message, *args)


def compile_requested() -> bool:
    """False when KVLLM_FLEX_COMPILE is 0/false/no/off, or an earlier compile failed."""
    if _compile_failure is not None:
        return False
    return os.environ.get(COMPILE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


# ---- metadata ------------------------------------------------------------------------------------


@dataclass
class FlexAttentionMetadata:
    """One step's batch as FlexAttention masks need it; block masks are built lazily and shared.

    Tensors are on the device unless named *_cpu. Request index `pad_req` is a padding row of
    `block_table` / `seq_lens` (seq_len 0): padded query rows point at it and see nothing.
    """

    num_actual_tokens: int
    num_reqs: int
    block_size: int
    causal: bool
    pad_req: int
    query_start_loc_cpu: torch.Tensor  # int64 [num_reqs + 1]
    seq_lens_cpu: torch.Tensor  # int64 [num_reqs]
    context_lens_cpu: torch.Tensor  # int64 [num_reqs]
    q_req_cpu: torch.Tensor  # int64 [num_actual_tokens]: request of each query token
    q_req: torch.Tensor  # int32 [num_actual_tokens]
    q_pos: torch.Tensor  # int32 [num_actual_tokens]: absolute position of each query token
    block_table: torch.Tensor  # int32 [pad_req + 1, max_blocks_per_req]; fixed shape across steps
    seq_lens: torch.Tensor  # int32 [pad_req + 1]; 0 past num_reqs
    write_tokens: torch.Tensor  # int64: query tokens whose K/V go into the cache (slot >= 0)
    write_slots: torch.Tensor  # int64: their slots
    masks: dict[tuple[Any, ...], StepMask] = field(default_factory=dict, repr=False)


@dataclass
class StepMask:
    """A layer configuration's BlockMask for one step, and the pages an eager run gathers."""

    block_mask: BlockMask
    pages: torch.Tensor | None  # eager paged path: physical pages copied into a compact KV


class FlexAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Per-token request/position tables and fixed-shape copies of the block table and seq_lens."""

    def build(self, common: CommonAttentionMetadata) -> FlexAttentionMetadata:
        num_reqs, num_tokens = common.num_reqs, common.num_actual_tokens
        if num_reqs > self.max_num_reqs:
            raise ValueError(f"batch of {num_reqs} requests exceeds max_num_reqs={self.max_num_reqs}")
        if common.max_seq_len > self.max_model_len:
            raise ValueError(
                f"sequence of {common.max_seq_len} tokens exceeds max_model_len={self.max_model_len}"
            )
        block_size = self.kv_cache_spec.block_size
        device = self.device
        qsl = common.query_start_loc_cpu.long()
        seq_lens_cpu = common.seq_lens_cpu.long()
        query_lens = qsl[1:] - qsl[:-1]
        context_lens = seq_lens_cpu - query_lens
        q_req_cpu = torch.repeat_interleave(torch.arange(num_reqs), query_lens)
        q_pos_cpu = torch.arange(num_tokens) - qsl[q_req_cpu] + context_lens[q_req_cpu]

        # Fixed shapes ([max_num_reqs + 1, blocks of max_model_len]) keep compiled graphs valid
        # across steps; the extra row is the padding request.
        max_blocks = -(-self.max_model_len // block_size)
        cols = min(max_blocks, common.block_table.shape[1])
        block_table = torch.zeros(self.max_num_reqs + 1, max_blocks, dtype=torch.int32, device=device)
        block_table[:num_reqs, :cols] = common.block_table[:num_reqs, :cols].to(device, torch.int32)
        seq_lens = torch.zeros(self.max_num_reqs + 1, dtype=torch.int32, device=device)
        seq_lens[:num_reqs] = common.seq_lens[:num_reqs].to(device, torch.int32)

        slot_mapping = common.slot_mapping[:num_tokens].to(device)
        write_tokens = torch.nonzero(slot_mapping >= 0).flatten()
        return FlexAttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=num_reqs,
            block_size=block_size,
            causal=common.causal,
            pad_req=self.max_num_reqs,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens_cpu,
            context_lens_cpu=context_lens,
            q_req_cpu=q_req_cpu,
            q_req=q_req_cpu.to(device, torch.int32),
            q_pos=q_pos_cpu.to(device, torch.int32),
            block_table=block_table,
            seq_lens=seq_lens,
            write_tokens=write_tokens,
            write_slots=slot_mapping[write_tokens],
        )


# ---- block-mask construction -------------------------------------------------------------------


def tile_pages(
    meta: FlexAttentionMetadata, causal: bool, sliding_window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (query tile, request, logical page) such that some token of the request in that
    tile may read some slot of the page. CPU int64 tensors of equal length; work is linear in
    their length, i.e. in the pages the step actually reads.
    """
    bs = meta.block_size
    starts, ends = meta.query_start_loc_cpu[:-1], meta.query_start_loc_cpu[1:]
    first_tile, last_tile = starts // Q_TILE, (ends - 1) // Q_TILE
    tiles_per_req = (last_tile - first_tile + 1).clamp(min=0)
    req = torch.repeat_interleave(torch.arange(meta.num_reqs), tiles_per_req)
    tile = first_tile[req] + _ranks(tiles_per_req)
    # First and last query token of the request inside the tile, as absolute positions.
    tok0 = torch.maximum(starts[req], tile * Q_TILE)
    tok1 = torch.minimum(ends[req], (tile + 1) * Q_TILE) - 1
    pos0 = meta.context_lens_cpu[req] + tok0 - starts[req]
    pos1 = meta.context_lens_cpu[req] + tok1 - starts[req]
    hi = pos1 // bs if causal else (meta.seq_lens_cpu[req] - 1) // bs
    lo = (pos0 - sliding_window + 1).clamp(min=0) // bs if sliding_window else torch.zeros_like(hi)
    pages_per_seg = (hi - lo + 1).clamp(min=0)
    seg = torch.repeat_interleave(torch.arange(len(req)), pages_per_seg)
    return tile[seg], req[seg], lo[seg] + _ranks(pages_per_seg)


def _ranks(counts: torch.Tensor) -> torch.Tensor:
    """[0..c0-1, 0..c1-1, ...] for counts [c0, c1, ...]."""
    total = int(counts.sum())
    offsets = torch.cumsum(counts, 0) - counts
    return torch.arange(total) - torch.repeat_interleave(offsets, counts)


def paged_kv_blocks(
    meta: FlexAttentionMetadata,
    causal: bool,
    sliding_window: int | None,
    num_q_tiles: int,
    num_blocks: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_num_blocks [num_q_tiles] and kv_indices [num_q_tiles, width] (int32, device): for each
    query tile the distinct physical pages it reads, ascending. Pages shared by several requests
    of a tile (prefix caching) are listed once: a page listed twice would be attended twice.
    """
    device = meta.block_table.device
    tile, req, logical = tile_pages(meta, causal, sliding_window)
    pages = meta.block_table[req.to(device), logical.to(device)].long()
    keys = torch.unique(tile.to(device) * num_blocks + pages)  # sorted: by tile, then page
    key_tile, key_page = keys // num_blocks, keys % num_blocks
    counts = torch.bincount(key_tile, minlength=num_q_tiles)
    column = torch.arange(len(keys), device=device) - (torch.cumsum(counts, 0) - counts)[key_tile]
    kv_indices = torch.zeros(num_q_tiles, width, dtype=torch.int32, device=device)
    kv_indices[key_tile, column] = key_page.to(torch.int32)
    return counts.to(torch.int32), kv_indices


def physical_to_logical(meta: FlexAttentionMetadata, num_blocks: int) -> torch.Tensor:
    """int32 [num_blocks]: the logical page index of each physical page in this step, or -1.

    Invariant relied on: a page shared by several requests sits at the same logical index in
    each (prefix caching shares whole prefixes). A page repeated within one table keeps its
    latest logical index, the one whose contents it holds.
    """
    bt = meta.block_table[: meta.num_reqs].long()
    num_valid = (meta.seq_lens[: meta.num_reqs].long() + meta.block_size - 1) // meta.block_size
    cols = torch.arange(bt.shape[1], device=bt.device).expand_as(bt)
    target = torch.where(cols < num_valid[:, None], bt, num_blocks)  # invalid entries -> a spare bucket
    inverse = torch.full((num_blocks + 1,), -1, dtype=torch.long, device=bt.device)
    inverse.scatter_reduce_(0, target.flatten(), cols.flatten(), reduce="amax")
    return inverse[:num_blocks].to(torch.int32)


def paged_mask_mod(
    q_req: torch.Tensor,
    q_pos: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_logical: torch.Tensor,  # [pages in the KV layout]: logical page index, -1 = unused
    kv_physical: torch.Tensor,  # [pages in the KV layout]: physical page id
    block_size: int,
    causal: bool,
    sliding_window: int | None,
) -> MaskMod:
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        req = q_req[q_idx]
        page = kv_idx // block_size
        logical = kv_logical[page]
        kv_pos = logical * block_size + kv_idx % block_size
        owned = (logical >= 0) & (block_table[req, logical.clamp(min=0)] == kv_physical[page])
        visible = owned & (kv_pos < seq_lens[req])
        if causal:
            visible = visible & (kv_pos <= q_pos[q_idx])
        if sliding_window is not None:
            visible = visible & (kv_pos > q_pos[q_idx] - sliding_window)
        return visible

    return mask_mod


def encoder_mask_mod(
    q_req: torch.Tensor, q_pos: torch.Tensor, pad_req: int, sliding_window: int | None
) -> MaskMod:
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        req = q_req[q_idx]
        visible = (req == q_req[kv_idx]) & (req != pad_req)
        if sliding_window is not None:
            visible = visible & (q_pos[kv_idx] > q_pos[q_idx] - sliding_window)
        return visible

    return mask_mod


def encoder_kv_blocks(meta: FlexAttentionMetadata, num_q_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KV tiles (of Q_TILE tokens) for bidirectional attention within the step's own tokens:
    the requests of a query tile are contiguous, so their tokens span one contiguous tile range.
    """
    num_tokens = meta.num_actual_tokens
    num_real = -(-num_tokens // Q_TILE)
    tiles = torch.arange(num_real)
    first_req = meta.q_req_cpu[tiles * Q_TILE]
    last_req = meta.q_req_cpu[torch.clamp((tiles + 1) * Q_TILE, max=num_tokens) - 1]
    lo = meta.query_start_loc_cpu[first_req] // Q_TILE
    hi = (meta.query_start_loc_cpu[last_req + 1] - 1) // Q_TILE
    counts = torch.zeros(num_q_tiles, dtype=torch.int64)
    counts[:num_real] = hi - lo + 1
    kv_indices = torch.zeros(num_q_tiles, num_q_tiles, dtype=torch.int64)
    kv_indices[:num_real] = (lo[:, None] + torch.arange(num_q_tiles)).clamp(max=num_q_tiles - 1)
    device = meta.block_table.device
    return counts.to(device, torch.int32), kv_indices.to(device, torch.int32)


def _pad(x: torch.Tensor, length: int, value: int) -> torch.Tensor:
    out = torch.full((length,), value, dtype=x.dtype, device=x.device)
    out[: x.shape[0]] = x
    return out


def _block_mask(
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    tiles: tuple[int, int],
    mask_mod: MaskMod,
    seq_lengths: tuple[int, int],
) -> BlockMask:
    return BlockMask.from_kv_blocks(
        kv_num_blocks[None, None],
        kv_indices[None, None],
        BLOCK_SIZE=tiles,
        mask_mod=mask_mod,
        seq_lengths=seq_lengths,
        compute_q_blocks=False,  # inference only: the transposed (backward) index is never read
    )


# ---- implementation ------------------------------------------------------------------------------


class FlexAttentionImpl(AttentionImpl):
    """Per-layer FlexAttention: writes K/V by slot mapping, then one flex_attention call per step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.sinks is not None:
            raise ValueError("FLEX_ATTENTION does not support attention sinks")
        if self.attn_type not in ("decoder", "encoder_only"):
            raise ValueError(
                f"FLEX_ATTENTION does not support attention type {self.attn_type} (supported: decoder, encoder_only)"
            )
        if self.kv_cache_dtype not in ("auto", "float16", "bfloat16"):
            raise ValueError(
                f"FLEX_ATTENTION does not support kv_cache_dtype {self.kv_cache_dtype} "
                "(supported: auto, float16, bfloat16)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        self.score_mod = _soft_cap_score_mod(self.logits_soft_cap) if self.logits_soft_cap else None
        self.use_compile = compile_requested()
        if self.use_compile:
            _announce_once(
                "compiled",
                logging.INFO,
                "FLEX_ATTENTION: torch.compile'd flex_attention; query lengths padded to powers of two >= %d",
                Q_TILE,
            )
        elif _compile_failure is None:  # after a failure, _disable_compile has warned already
            _announce_once(
                "eager",
                logging.INFO,
                "FLEX_ATTENTION: eager flex_attention (%s=0); scores are materialized, expect it to be slow",
                COMPILE_ENV,
            )

    def forward(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlexAttentionMetadata,
    ) -> torch.Tensor:
        meta = attn_metadata
        num_tokens = query.shape[0]
        if self.attn_type == "encoder_only":
            # Encoder-only layers keep no cache: queries attend to the step's own keys.
            dtype = query.dtype
            key_src = key[: meta.num_actual_tokens].contiguous()  # fixed strides, see _pad_rows
            value_src = value[: meta.num_actual_tokens].contiguous()
        else:
            key_cache, value_cache = kv_cache[0], kv_cache[1]
            self._write_cache(key_cache, value_cache, key, value, meta)
            dtype = key_cache.dtype
            key_src = key_cache.reshape(-1, self.num_kv_heads, self.head_size)
            value_src = value_cache.reshape(-1, self.num_kv_heads, self.head_size)

        if self.use_compile:
            try:
                return self._attend(query, key_src, value_src, meta, dtype, compiled=True)[:num_tokens]
            except torch._dynamo.exc.TorchDynamoException as exc:  # tracing or backend compile failed
                _disable_compile(exc)
                self.use_compile = False
        return self._attend(query, key_src, value_src, meta, dtype, compiled=False)[:num_tokens]

    def _write_cache(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: FlexAttentionMetadata,
    ) -> None:
        slots, tokens = meta.write_slots, meta.write_tokens
        blocks, offsets = slots // meta.block_size, slots % meta.block_size
        key_cache[blocks, offsets] = key[tokens].to(key_cache.dtype)
        value_cache[blocks, offsets] = value[tokens].to(value_cache.dtype)

    def _attend(
        self,
        query: torch.Tensor,
        key_src: torch.Tensor,
        value_src: torch.Tensor,
        meta: FlexAttentionMetadata,
        dtype: torch.dtype,
        compiled: bool,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        q_len = query_bucket(num_tokens) if compiled else -(-num_tokens // Q_TILE) * Q_TILE
        step_mask = self._step_mask(meta, key_src.shape[0], q_len, compiled)
        if step_mask.pages is not None:
            # Eager: only the pages this step reads, as [pages * block_size] contiguous slots.
            paged = (-1, meta.block_size, self.num_kv_heads, self.head_size)
            key_src = key_src.view(paged)[step_mask.pages].flatten(0, 1)
            value_src = value_src.view(paged)[step_mask.pages].flatten(0, 1)
        kv_len = step_mask.block_mask.seq_lengths[1]
        q = _pad_rows(query.to(dtype), q_len).transpose(0, 1).unsqueeze(0)
        if key_src.shape[0] != kv_len:  # encoder-only: the step's own keys, padded like the queries
            key_src, value_src = _pad_rows(key_src, kv_len), _pad_rows(value_src, kv_len)
        k = key_src.to(dtype).transpose(0, 1).unsqueeze(0)
        v = value_src.to(dtype).transpose(0, 1).unsqueeze(0)
        kernel = _get_compiled_flex() if compiled else flex_attention
        out = kernel(
            q,
            k,
            v,
            score_mod=self.score_mod,
            block_mask=step_mask.block_mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
            kernel_options=_kernel_options(q.device, step_mask.block_mask.BLOCK_SIZE[1]),
        )
        return out[0].transpose(0, 1).to(query.dtype)

    def _step_mask(self, meta: FlexAttentionMetadata, kv_slots: int, q_len: int, compiled: bool) -> StepMask:
        encoder = self.attn_type == "encoder_only"
        causal = meta.causal and not encoder
        key = (encoder, causal, self.sliding_window, q_len, kv_slots, compiled)
        if key not in meta.masks:
            meta.masks[key] = build_step_mask(
                meta,
                encoder=encoder,
                causal=causal,
                sliding_window=self.sliding_window,
                q_len=q_len,
                num_blocks=kv_slots // meta.block_size,
                compiled=compiled,
            )
        return meta.masks[key]


def build_step_mask(
    meta: FlexAttentionMetadata,
    *,
    encoder: bool,
    causal: bool,
    sliding_window: int | None,
    q_len: int,
    num_blocks: int,
    compiled: bool,
) -> StepMask:
    """The BlockMask for one layer configuration of one step (q_len a multiple of Q_TILE).

    compiled: KV is the physical cache, with the sparse page structure from the block tables.
    Eager (paged): KV is a compact copy of the pages the step reads, listed densely, because
    eager flex_attention evaluates the mask over every (query, key) pair anyway.
    """
    num_q_tiles = q_len // Q_TILE
    q_req = _pad(meta.q_req, q_len, meta.pad_req)
    q_pos = _pad(meta.q_pos, q_len, -1)
    if encoder:
        kv_num_blocks, kv_indices = encoder_kv_blocks(meta, num_q_tiles)
        mask_mod = encoder_mask_mod(q_req, q_pos, meta.pad_req, sliding_window)
        return StepMask(
            _block_mask(kv_num_blocks, kv_indices, (Q_TILE, Q_TILE), mask_mod, (q_len, q_len)), None
        )

    bs = meta.block_size
    device = meta.block_table.device
    inverse = physical_to_logical(meta, num_blocks)
    if compiled:
        # The CPU kernel requires kv_indices as wide as the KV sequence has tiles; the GPU
        # kernel only needs room for what one query tile can read.
        width = num_blocks if device.type == "cpu" else min(num_blocks, Q_TILE * meta.block_table.shape[1])
        kv_num_blocks, kv_indices = paged_kv_blocks(
            meta, causal, sliding_window, num_q_tiles, num_blocks, width
        )
        kv_physical = torch.arange(num_blocks, dtype=torch.int32, device=device)
        mask_mod = paged_mask_mod(
            q_req, q_pos, meta.block_table, meta.seq_lens, inverse, kv_physical, bs, causal, sliding_window
        )
        return StepMask(
            _block_mask(kv_num_blocks, kv_indices, (Q_TILE, bs), mask_mod, (q_len, num_blocks * bs)), None
        )

    tile, req, logical = tile_pages(meta, causal, sliding_window)
    pages = torch.unique(meta.block_table[req.to(device), logical.to(device)].long())
    num_pages = pages.shape[0]
    kv_num_blocks = torch.full((num_q_tiles,), num_pages, dtype=torch.int32, device=device)
    kv_indices = torch.arange(num_pages, dtype=torch.int32, device=device).expand(num_q_tiles, -1)
    mask_mod = paged_mask_mod(
        q_req,
        q_pos,
        meta.block_table,
        meta.seq_lens,
        inverse[pages],
        pages.to(torch.int32),
        bs,
        causal,
        sliding_window,
    )
    return StepMask(
        _block_mask(kv_num_blocks, kv_indices, (Q_TILE, bs), mask_mod, (q_len, num_pages * bs)), pages
    )


def _pad_rows(x: torch.Tensor, length: int) -> torch.Tensor:
    """A fresh contiguous [length, ...] copy, zero past x's rows. Always a copy: compiled graphs
    are specialized on strides, and the caller's views (e.g. q split from a fused qkv) vary.
    """
    out = x.new_zeros((length, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def _soft_cap_score_mod(cap: float) -> ScoreMod:
    def score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    return score_mod


def _kernel_options(device: torch.device, kv_tile: int) -> dict[str, Any] | None:
    if device.type == "cpu":
        return None
    # The Triton kernel's tiles must divide the BlockMask tiles (Q_TILE x one page); the
    # decoding kernel assumes one query tile per batch row, which a packed batch is not.
    return {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": Q_TILE, "BLOCK_N": math.gcd(kv_tile, 64)}


def _disable_compile(exc: Exception) -> None:
    global _compile_failure
    _compile_failure = f"torch.compile failed: {type(exc).__name__}: {exc}"
    _announce_once(
        "compile-failed",
        logging.WARNING,
        "FLEX_ATTENTION: %s; falling back to eager flex_attention for this process",
        _compile_failure,
    )
