"""y = x @ W^T (+ bias) for a few rows of x (decode batches), in one Triton launch (two with split-K).

Reference: `torch.nn.functional.linear`. At decode batch sizes a linear layer is a read of its weight
matrix, so the kernel is built around streaming W once: each program owns BLOCK_N output columns for
all (up to MAX_ROWS) rows of x and walks K in BLOCK_K tiles, which Triton's software pipeline prefetches
num_stages - 1 ahead into shared memory (16-byte cp.async on sm_80+). The product is a tensor-core dot of
the x tile [16, BLOCK_K] (rows past M masked: zero-filled, never fetched) with the W tile, accumulated
in float32: for M = 1 most of that dot is wasted, but tensor cores have compute to spare here, and one
compiled variant serves every M (M is not specialized on).

When N alone gives too few programs for the GPU (Qwen3-0.6B's o_proj and down_proj have N = 1024, 64
tiles of 16), K is split over SPLIT_K programs that write float32 partial sums, and a second small
kernel adds them in a fixed order (deterministic), adds the bias and casts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvllm.layers.ops.common import cast_to, interpreting
from kvllm.layers.ops.dispatch import use_fused_ops

MAX_ROWS = 16  # rows of x per call; the dot's M (16 is also the smallest tensor-core tile)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_N = 16
TARGET_PROGRAMS = 256  # about two per SM on an H200 (132 SMs): split K below this many column tiles
MAX_SPLIT_K = 8
REDUCE_BLOCK = 1024


@triton.jit(do_not_specialize=["M"])  # the decode batch size changes every step
def _small_m_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_start + offs_k)[None, :]
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (k + offs_k) < k_end
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if INTERPRET and dtype == tl.bfloat16:
            # The interpreter's dot multiplies bfloat16's raw bits; float32 products of bfloat16 are exact.
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if dtype == tl.float32:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")  # not TF32
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, cast_to(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask)
    else:
        partial_ptrs = partial_ptr + (pid_k * BLOCK_M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(partial_ptrs, acc, mask=mask)


@triton.jit
def _split_k_reduce_kernel(
    partial_ptr,
    bias_ptr,
    out_ptr,
    N,
    stride_om,
    BLOCK_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + (split * BLOCK_M + row) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, cast_to(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


@dataclass(frozen=True)
class LinearConfig:
    """Launch parameters: K per tile, programs along K (a power of two), warps and pipeline stages."""

    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def default_config(n: int, k: int, dtype: torch.dtype) -> LinearConfig:
    """512 bytes of each W row per tile; K split in a power of two that brings the column tiles up to
    TARGET_PROGRAMS, keeping at least one tile per program."""
    block_k = 128 if dtype == torch.float32 else 256
    tiles = triton.cdiv(n, BLOCK_N)
    max_split = max(1, min(MAX_SPLIT_K, k // block_k))
    split = 1
    while tiles * split < TARGET_PROGRAMS and split * 2 <= max_split:
        split *= 2
    return LinearConfig(block_k=block_k, split_k=split)


def is_narrow(weight: torch.Tensor) -> bool:
    """Whether weight [N, K] has too few output columns for cuBLAS to fill an H200 at decode sizes:
    fewer 16-column tiles than TARGET_PROGRAMS (Qwen3-0.6B's o_proj and down_proj, N = 1024)."""
    return triton.cdiv(weight.shape[0], BLOCK_N) < TARGET_PROGRAMS


def use_small_m_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` should run this kernel: fused ops on for x (CUDA, or forced), x a
    [M, K] matrix with 1 <= M <= MAX_ROWS and a contiguous last dimension, weight a contiguous [N, K]
    matrix of x's dtype and device, K a multiple of 16 (rows of W 16-byte aligned for wide loads),
    and a narrow output (fewer column tiles than TARGET_PROGRAMS). On an H200 cuBLAS streams wide
    weights as fast or faster (Qwen3-0.6B, M = 1: qkv 4.9 vs 5.2 us, gate_up 5.8 vs 6.9 us) and
    leaves narrow ones underfilled (o_proj 12.8 vs 5.7 us; down_proj even), benchmarks/h200/linear_bench.py."""
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and weight.dim() == 2
        and is_narrow(weight)
        and x.shape[1] == weight.shape[1]
        and x.shape[1] > 0
        and x.shape[1] % 16 == 0
        and x.dtype == weight.dtype
        and x.dtype in SUPPORTED_DTYPES
        and x.stride(1) == 1
        and weight.is_contiguous()
        and x.device == weight.device
        and use_fused_ops(x)
    )


def check_operands(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    max_rows: int = MAX_ROWS,
    kernel: str = "the small-M kernel",
) -> None:
    """The layout a decode linear kernel needs (this one, and the GEMV's): x [M <= max_rows, K >= 1]
    with a contiguous last dimension, a contiguous weight [N, K] and bias [N], one 16-bit or float32
    dtype, one device; a ValueError saying what differs otherwise."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear needs x [M, K] and weight [N, K], got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if x.shape[1] == 0:
        raise ValueError("linear needs K >= 1 (x and weight have no columns)")
    if x.shape[0] > max_rows:
        raise ValueError(f"x has {x.shape[0]} rows; {kernel} takes at most {max_rows}")
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"x and weight must share one of {SUPPORTED_DTYPES}, got {x.dtype} and {weight.dtype}"
        )
    if x.stride(1) != 1:
        raise ValueError(f"x needs a contiguous last dimension, got strides {tuple(x.stride())}")
    if not weight.is_contiguous():
        raise ValueError(
            f"weight must be contiguous (row-major [N, K]), got strides {tuple(weight.stride())}"
        )
    if weight.numel() >= 2**31:
        raise ValueError(f"weight {tuple(weight.shape)} is too large for the kernel's 32-bit offsets")
    if bias is not None and (
        bias.shape != (weight.shape[0],) or bias.stride(0) != 1 or bias.dtype != x.dtype
    ):
        raise ValueError(
            f"bias must be a contiguous [{weight.shape[0]}] {x.dtype} tensor, got {tuple(bias.shape)} "
            f"{bias.dtype} with strides {tuple(bias.stride())}"
        )
    devices = {x.device, weight.device} | ({bias.device} if bias is not None else set())
    if len(devices) != 1:
        raise ValueError(f"x, weight and bias must be on one device, got {sorted(map(str, devices))}")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: LinearConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, for 0 <= M <= MAX_ROWS.

    Accumulates in float32 and rounds once, as F.linear does. `config` overrides `default_config`
    (benchmarks sweep it).
    """
    check_operands(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    config = config or default_config(n, k, x.dtype)
    block_k, split = config.block_k, config.split_k
    if block_k < 16 or block_k & (block_k - 1) or split < 1 or split & (split - 1):
        raise ValueError(f"block_k (at least 16) and split_k must be powers of two, got {config}")
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no program without a K tile
    partial = torch.empty((split, MAX_ROWS, n), dtype=torch.float32, device=x.device) if split > 1 else out
    bias_arg = bias if bias is not None else weight  # unused unless HAS_BIAS
    interpret = interpreting()
    _small_m_linear_kernel[(triton.cdiv(n, BLOCK_N), split)](
        x, weight, bias_arg, out, partial,
        m, n, k, k_per_split,
        x.stride(0) if m > 1 else k,  # a lone row's stride is arbitrary; keep it off the specializations
        weight.stride(0), out.stride(0),
        BLOCK_M=MAX_ROWS,
        BLOCK_N=BLOCK_N,
        BLOCK_K=block_k,
        SPLIT_K=split,
        EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None,
        INTERPRET=interpret,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    if split > 1:
        reduce_split_k(partial, bias, out, split, MAX_ROWS)
    return out


def reduce_split_k(
    partial: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, split: int, partial_rows: int
) -> None:
    """out [M, N] = the sum of float32 partials [split, partial_rows, N] in a fixed order (+ bias),
    cast to out's dtype: the second launch of a split-K linear kernel (this one, W4A16's)."""
    m, n = out.shape
    _split_k_reduce_kernel[(m, triton.cdiv(n, REDUCE_BLOCK))](
        partial, bias if bias is not None else out, out, n, out.stride(0),
        BLOCK_M=partial_rows,
        SPLIT_K=split,
        BLOCK=REDUCE_BLOCK,
        HAS_BIAS=bias is not None,
        INTERPRET=interpreting(),
        num_warps=4,
    )  # fmt: skip
