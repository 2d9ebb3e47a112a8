"""y = x @ W^T (+ bias) for 1 to 4 rows of x (batch-1 to batch-4 decode), one Triton launch, no reduce.

Reference: `torch.nn.functional.linear`. At these row counts a projection is a stream of its weight,
and the time that matters is how fast the whole matrix is in flight. The tensor-core kernel in
`linear.py` needs 16 columns per program, which leaves a 1024-column output (o_proj, down_proj) only
64 programs and needs a split-K reduce kernel after it. Here a program owns BLOCK_N (2 to 16) columns
for every row of x and the whole of K, multiplies in float32 on the CUDA cores (a [rows, BLOCK_N,
BLOCK_K] broadcast product summed over K: the FMAs are free next to the loads) and writes its outputs
once: enough programs for any width, and no second kernel. On an H200 the fastest programs are small
(one warp, two columns, a whole 1024-element row per tile): many of them keep the most loads in flight.

The row count is a compile-time BLOCK_M of 1, 2 or 4 (rows past M masked), so at most three variants
per weight shape are compiled, all at start-up warm-up.

`gemv_silu_and_mul` runs a fused gate_up projection ([2d, K]: gate rows, then up rows) and applies
silu(gate) * up in the epilogue: each program reads its columns of both halves, so the activation
kernel and the [M, 2d] intermediate disappear. It rounds where the unfused path does (the projection
to the activation dtype, silu, the product), so its outputs are the unfused path's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvllm.layers.ops.common import cast_to, gated_silu, interpreting
from kvllm.layers.ops.linear import check_operands
from kvllm.utils.pdl import pdl_enabled, pdl_launch_options, wait_for_previous_kernel

MAX_ROWS = 4
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    SINGLE_TILE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    PREFETCH_W: tl.constexpr,
    USE_PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # GATED: N is the output width d; W holds 2d rows (gate, then up) and out gets silu(gate) * up.
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_offset = N * stride_wn  # GATED only: the up half's rows follow the gate half's
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SINGLE_TILE:
        # K <= BLOCK_K, one tile: the weights may load before the wait (PDL: they overlap the previous kernel).
        if EVEN_K:  # K == BLOCK_K: no K mask, so the loads vectorize
            k_mask = offs_k < BLOCK_K
        else:
            k_mask = offs_k < K
        w_mask = n_mask[:, None] & k_mask[None, :]
        if PREFETCH_W:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            if GATED:
                w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0)
            wait_for_previous_kernel(USE_PDL)
        else:
            wait_for_previous_kernel(USE_PDL)
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            if GATED:
                w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if GATED:
            acc_up += tl.sum(x[:, None, :] * w_up.to(tl.float32)[None, :, :], axis=2)
    else:
        wait_for_previous_kernel(USE_PDL)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                w_mask = n_mask[:, None]
                x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0).to(tl.float32)
            else:
                k_mask = (k + offs_k) < K
                w_mask = n_mask[:, None] & k_mask[None, :]
                x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
            if GATED:
                w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0).to(tl.float32)
                acc_up += tl.sum(x[:, None, :] * w_up[None, :, :], axis=2)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    if GATED:
        acc = gated_silu(acc, acc_up, dtype, INTERPRET)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, cast_to(acc, dtype, INTERPRET), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class GemvConfig:
    """Columns per program, K per loop iteration (powers of two), warps and pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1


def default_config(n: int, k: int, dtype: torch.dtype) -> GemvConfig:
    """K in one tile up to 2048 elements (4096 for 16-bit types), read by one-warp programs of two
    columns; longer rows by four-warp programs of four columns. The fastest of 96 configs for each of
    Qwen3-0.6B's projections at M = 1 on an H200 (benchmarks/h200/gemv_bench.py: qkv 4.25 us, o 3.45,
    gate_up 5.24, down 4.23, against cuBLAS 4.95 / 12.66 / 6.11 / 6.61)."""
    block_k = min(triton.next_power_of_2(max(k, 16)), 2048 if dtype == torch.float32 else 4096)
    if block_k <= 2048:
        return GemvConfig(block_n=2, block_k=block_k, num_warps=1)
    return GemvConfig(block_n=4, block_k=block_k, num_warps=4)


def use_gemv(x: torch.Tensor, weight: torch.Tensor, narrow: bool) -> bool:
    """Whether `linear(x, weight)` should run this kernel: one row of x, or up to MAX_ROWS rows when
    the output is narrow (`narrow`: too few columns for cuBLAS to fill the GPU), 16-bit or float32
    operands of one dtype and device, contiguous. At 2-4 rows cuBLAS stays faster on wide outputs
    (Qwen3-0.6B, M = 4: qkv 5.30 vs 5.61 us, gate_up 5.96 vs 7.48) and this kernel wins on narrow ones
    (o 4.43 vs 5.87 for the tensor-core small-M kernel, down 5.81 vs 5.90)."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and (x.shape[0] == 1 or (narrow and 1 <= x.shape[0] <= MAX_ROWS))
        and x.shape[1] == weight.shape[1]
        and x.shape[1] > 0
        and x.dtype == weight.dtype
        and x.dtype in SUPPORTED_DTYPES
        and x.stride(1) == 1
        and weight.is_contiguous()
        and weight.numel() < 2**31
        and x.device == weight.device
    )


def block_m_for(m: int) -> int:
    """The compiled row count for m rows: 1, 2 or 4."""
    return 1 if m <= 1 else 2 if m == 2 else 4


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_operands(x, weight, bias, MAX_ROWS, "the GEMV kernel")


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    constant_weight: bool = False,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, for 0 <= M <= MAX_ROWS.

    Accumulates in float32 and rounds once, as F.linear does. `config` overrides `default_config`.
    `constant_weight`: no kernel of the step writes `weight` (a layer's parameter), so under PDL it
    loads while the previous kernel finishes (`kvllm/layers/ops/pdl.py`).
    """
    _check(x, weight, bias)
    config = config or default_config(*weight.shape, x.dtype)
    return _launch(x, weight, bias, weight.shape[0], config, False, constant_weight)


def gemv_silu_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    constant_weight: bool = False,
) -> torch.Tensor:
    """silu(gate) * up of the fused projection x @ weight^T (+ bias), weight [2d, K] holding the gate
    rows then the up rows -> [M, d], for 0 <= M <= MAX_ROWS (see the module docstring and `gemv`)."""
    _check(x, weight, bias)
    if weight.shape[0] % 2:
        raise ValueError(
            f"a gate_up weight has an even number of rows (gate, then up), got {weight.shape[0]}"
        )
    if config is None:  # the same programs as the plain projection of 2d rows: half the columns each
        plain = default_config(*weight.shape, x.dtype)
        config = GemvConfig(max(1, plain.block_n // 2), plain.block_k, plain.num_warps, plain.num_stages)
    return _launch(x, weight, bias, weight.shape[0] // 2, config, True, constant_weight)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    config: GemvConfig,
    gated: bool,
    constant_weight: bool,
) -> torch.Tensor:
    m, k = x.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    for name in ("block_n", "block_k"):
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {config}")
    use_pdl = pdl_enabled(x)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight, out,
        m, n, k,
        x.stride(0) if m > 1 else k,  # a lone row's stride is arbitrary; keep it off the specializations
        weight.stride(0), out.stride(0),
        BLOCK_M=block_m_for(m),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0,
        SINGLE_TILE=k <= config.block_k,
        HAS_BIAS=bias is not None,
        GATED=gated,
        PREFETCH_W=constant_weight,
        USE_PDL=use_pdl,
        INTERPRET=interpreting(),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_launch_options(use_pdl),
    )  # fmt: skip
    return out
