"""The mixture-of-experts feed-forward as two grouped GEMMs in Triton (vLLM's fused-MoE scheme).

Same contract and layout as `fused_experts_torch`. The T * k (token, expert) pairs are sorted by
expert and each expert's run is padded to a multiple of BLOCK_M (`moe_align_block_size`), so every
BLOCK_M tile of the sorted list belongs to one expert; one program computes one [BLOCK_M, BLOCK_N]
output tile of one such block against that expert's weight matrix (a grouped GEMM: the tiles of all
experts in one launch). Padding slots hold the sentinel T * k and are neither read nor written.

GEMM 1 gathers hidden rows (pair p reads token p // k) and writes gate_up [T * k, 2I]; the activation
runs on that; GEMM 2 reads pair rows, scales each by its routing weight (in float32, before the one
rounding), and writes [T * k, H]; the k rows of a token are then summed. The alignment is two small
Triton launches with a fixed upper bound on the padded length, so nothing syncs with the host (it
was about twenty torch ops, each a kernel per MoE layer and step, graphs included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvllm.layers.moe.fused_moe_torch import apply_activation, check_fused_experts_args
from kvllm.layers.ops.activation import silu_and_mul
from kvllm.layers.ops.common import cast_to, interpreting

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["num_valid_pairs"])
def _fused_moe_kernel(
    a_ptr,
    b_ptr,
    bias_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_padded_ptr,
    N,
    K,
    num_valid_pairs,
    stride_am,
    stride_be,
    stride_bn,
    stride_biase,
    stride_cm,
    A_ROWS_PER_TOKEN: tl.constexpr,  # top_k when A holds tokens (GEMM 1), 1 when it holds pairs
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n_tiles
    pid_n = pid % num_n_tiles
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_ids = tl.load(sorted_pair_ids_ptr + offs_m)
    m_mask = pair_ids < num_valid_pairs
    a_rows = (pair_ids // A_ROWS_PER_TOKEN).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[:, None] * stride_bn + offs_k[None, :]
    dtype = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if INTERPRET and dtype == tl.bfloat16:
            # The interpreter's dot multiplies bfloat16's raw bits; float32 products of bfloat16 are exact.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if dtype == tl.float32:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")  # not TF32
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_biase + offs_n, mask=n_mask, other=0.0).to(tl.float32)[
            None, :
        ]
    if MUL_ROUTED_WEIGHT:
        weights = tl.load(topk_weights_ptr + pair_ids, mask=m_mask, other=0.0)
        acc = acc * weights[:, None]
    c_ptrs = c_ptr + pair_ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, cast_to(acc, c_ptr.dtype.element_ty, INTERPRET), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class FusedMoEConfig:
    """Tile sizes and launch parameters of the grouped GEMMs."""

    block_m: int
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_config(num_pairs: int, num_experts: int) -> FusedMoEConfig:
    """Small M tiles when experts get few rows each (decode), so little of a tile is padding."""
    rows_per_expert = num_pairs / max(num_experts, 1)
    if rows_per_expert <= 16:
        return FusedMoEConfig(block_m=16)
    if rows_per_expert <= 64:
        return FusedMoEConfig(block_m=32)
    return FusedMoEConfig(block_m=64, block_n=128, num_warps=8)


@triton.jit
def _count_experts_kernel(topk_ids_ptr, counts_ptr, ranks_ptr, num_pairs, BLOCK: tl.constexpr):
    """ranks[p] = how many pairs before p (in atomic order) chose p's expert; counts = the totals."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    experts = tl.load(topk_ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    ranks = tl.atomic_add(counts_ptr + experts, tl.full([BLOCK], 1, tl.int32), mask=mask)
    tl.store(ranks_ptr + offs, ranks, mask=mask)


@triton.jit
def _scatter_pairs_kernel(
    topk_ids_ptr,
    counts_ptr,
    ranks_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    num_experts,
    num_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Each program recomputes the padded run starts from the counts (cheap: E values) and places its
    pairs; program 0 also writes every tile's expert and the used length."""
    e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e, mask=e < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    experts = tl.load(topk_ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    ranks = tl.load(ranks_ptr + offs, mask=mask, other=0)
    if tl.program_id(0) == 0:
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
        for t0 in range(0, num_tiles, BLOCK_T):
            tiles = t0 + tl.arange(0, BLOCK_T)
            # the expert of a tile: how many runs end at or before its start (clamped to the last one)
            ends_before = (padded_end[None, :] <= (tiles * BLOCK_M)[:, None]) & (e < num_experts)[None, :]
            expert = tl.minimum(tl.sum(ends_before.to(tl.int32), axis=1), num_experts - 1)
            tl.store(block_expert_ids_ptr + tiles, expert, mask=tiles < num_tiles)
    # each pair's run start: the padded lengths of the experts before its own (no register gather)
    padded_start = tl.sum(tl.where(e[None, :] < experts[:, None], padded[None, :], 0), axis=1)
    tl.store(sorted_pair_ids_ptr + padded_start + ranks, offs, mask=mask)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, each expert's run padded to a multiple of block_m.

    Returns sorted_pair_ids [P] (pair index t * k + j, or the sentinel T * k in padding), block_expert_ids
    [P / block_m] (the expert of each tile; the last expert for tiles past the end, which the kernel
    skips) and num_padded [1] (the used length). P = T * k + E * (block_m - 1) rounded up to block_m: a
    bound that needs no host sync. Experts outside [0, E) are rejected by the caller. Two Triton launches
    (plus two fills): atomic counts and ranks, then the placement. Within an expert's run the pairs are
    in atomic order, not token order: every pair's row is computed on its own, so results do not
    depend on it.
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    capacity = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    num_tiles = capacity // block_m
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    block_expert_ids = torch.empty(num_tiles, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    if num_pairs == 0:
        return sorted_pair_ids, block_expert_ids.fill_(0), num_padded.fill_(0)
    _count_experts_kernel[(triton.cdiv(num_pairs, 256),)](flat, counts, ranks, num_pairs, BLOCK=256)
    block_e = triton.next_power_of_2(num_experts)
    block = max(16, min(256, 8192 // block_e))  # the [pairs, experts] comparison stays in registers
    _scatter_pairs_kernel[(triton.cdiv(num_pairs, block),)](
        flat, counts, ranks, sorted_pair_ids, block_expert_ids, num_padded, num_pairs, num_experts, num_tiles,
        BLOCK_M=block_m, BLOCK=block, BLOCK_E=block_e, BLOCK_T=max(16, 4096 // block_e),
    )  # fmt: skip
    return sorted_pair_ids, block_expert_ids, num_padded


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    topk_weights: torch.Tensor | None,
    alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_rows_per_token: int,
    config: FusedMoEConfig,
) -> None:
    sorted_pair_ids, block_expert_ids, num_padded = alignment
    n, k = b.shape[1], b.shape[2]
    grid = (block_expert_ids.numel() * triton.cdiv(n, config.block_n),)
    _fused_moe_kernel[grid](
        a, b, bias if bias is not None else b, out,
        topk_weights if topk_weights is not None else out,
        sorted_pair_ids, block_expert_ids, num_padded,
        n, k, out.shape[0],
        a.stride(0), b.stride(0), b.stride(1),
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        A_ROWS_PER_TOKEN=a_rows_per_token,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        HAS_BIAS=bias is not None,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        INTERPRET=interpreting(),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip


def _check_layout(hidden_states: torch.Tensor, tensors: dict[str, torch.Tensor | None]) -> None:
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"fused MoE supports {SUPPORTED_DTYPES}, got hidden_states {hidden_states.dtype}")
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device != hidden_states.device:
            raise ValueError(f"{name} is on {t.device}, hidden_states on {hidden_states.device}")
        if name != "topk_ids" and name != "topk_weights" and t.dtype != hidden_states.dtype:
            raise ValueError(f"{name} is {t.dtype}; it must match hidden_states ({hidden_states.dtype})")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension, got strides {tuple(t.stride())}")
    for name in ("w13", "w2"):
        w = tensors[name]
        assert w is not None
        if w.stride(1) != w.shape[2] or w.stride(0) != w.shape[1] * w.shape[2]:
            raise ValueError(f"{name} must be contiguous [E, N, K], got strides {tuple(w.stride())}")


def fused_experts_triton(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    config: FusedMoEConfig | None = None,
) -> torch.Tensor:
    """`fused_experts_torch`'s result from two grouped-GEMM launches. Returns [T, H] in hidden's dtype.

    GEMMs accumulate in float32 and round once to the dtype, as F.linear does; the routing weight is
    applied in float32 before GEMM 2's rounding (HF rounds after, then multiplies: within one ulp).
    """
    check_fused_experts_args(hidden_states, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    _check_layout(
        hidden_states,
        dict(
            w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias, topk_weights=topk_weights, topk_ids=topk_ids
        ),
    )
    num_tokens, hidden = hidden_states.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.empty_like(hidden_states)
    config = config or default_config(num_pairs, num_experts)
    alignment = moe_align_block_size(topk_ids, config.block_m, num_experts)
    gate_up = torch.empty((num_pairs, w13.shape[1]), dtype=hidden_states.dtype, device=hidden_states.device)
    _grouped_gemm(hidden_states, w13, w13_bias, gate_up, None, alignment, top_k, config)
    if activation == "silu":  # one launch, rounded as the torch ops round (kvllm/layers/ops/activation.py)
        intermediate = silu_and_mul(gate_up)
    else:
        intermediate = apply_activation(gate_up, activation)
    down = torch.empty((num_pairs, hidden), dtype=hidden_states.dtype, device=hidden_states.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(intermediate, w2, w2_bias, down, weights, alignment, 1, config)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
