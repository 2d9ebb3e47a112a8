"""fp8 (e4m3) W8A8 GEMMs: activation quantization per token or per (token, 128-column group), the
per-channel GEMM through torch._scaled_mm, and a Triton GEMM for 128x128 block-scaled weights
(DeepSeek-V3 / Qwen3-FP8's `weight_scale_inv`). References: `dequantize_block` / plain float32 torch.

From BLOCKWISE_MIN_ROWS rows a block-scaled layer runs torch's blockwise-scaled GEMM instead
(F.scaled_mm, 1x128 activation x 128x128 weight scales, cuBLAS) where this torch and GPU have it: on an
H200 (torch 2.11) it took 14.8 / 14.3 / 57.2 us against the Triton GEMM's 35.2 / 34.9 / 122 at 256 rows
of Llama-3-8B's qkv / o / gate_up, within 0.3% of float32 (quant_bench.py --parts fp8probe).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvllm.attention.ops.triton_reshape_and_cache import fp8_constexprs, fp8_quantize

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
BLOCKWISE_MIN_ROWS = 256  # torch's blockwise GEMM was measured at 256 rows only
MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros with this scale, not NaN


@triton.jit
def _quantize_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, stride_xm, K,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr,
    FP8_MIN_EXPONENT: tl.constexpr,
    FP8_ROUND_BY_HAND: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (offs < K)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), 448.0), 1e-12)
    # |x| / scale <= 448 up to the division's rounding, which the round to the fp8 grid absorbs.
    q = fp8_quantize(x, scale, q_ptr.dtype.element_ty, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT, FP8_ROUND_BY_HAND)
    tl.store(q_ptr + row * K + offs, q, mask=mask)
    tl.store(scale_ptr + row * tl.cdiv(K, GROUP) + group, scale)


def quantize_fp8(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scales [M, 1] per token, or [M, K / group_size] per group),
    x ~= q * scale with each row's (group's) largest magnitude mapped to 448. One Triton launch where
    fused ops are on (CUDA), torch ops otherwise (the reference; the same arithmetic)."""
    from kvllm.layers.ops.dispatch import use_fused_ops

    m, k = x.shape
    group = k if group_size is None else group_size
    if k % group:
        raise ValueError(f"fp8 group quantization needs K ({k}) to be a multiple of the group size {group}")
    if use_fused_ops(x) and x.stride(1) == 1:
        q = torch.empty((m, k), dtype=FP8, device=x.device)
        scale = torch.empty((m, k // group), dtype=torch.float32, device=x.device)
        if m:
            block = triton.next_power_of_2(group)
            _quantize_fp8_kernel[(m, k // group)](
                x, q, scale, x.stride(0), k, GROUP=group, BLOCK=block, **fp8_constexprs(FP8),
                num_warps=min(16, max(1, block // 512)),
            )  # fmt: skip
        return q, scale
    xg = x.float().view(m, k // group, group)
    # Over a tensor, not the Python number: on CUDA torch multiplies by a number's reciprocal, which rounds
    # differently from the IEEE division of the kernel (and of torch on the CPU).
    fp8_max = torch.full((), FP8_MAX, dtype=torch.float32, device=x.device)
    scale = (xg.abs().amax(dim=-1, keepdim=True) / fp8_max).clamp(min=MIN_SCALE)
    q = (xg / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, k), scale.view(m, k // group)


def scaled_mm_rowwise(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] (16-bit) @ (weight fp8 [N, K] * weight_scale [N])^T via torch._scaled_mm with a scale per
    token (dynamic, or the checkpoint's static `input_scale`) and per output channel."""
    if input_scale is None:
        xq, x_scale = quantize_fp8(x)
    else:
        x_scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
        xq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch._scaled_mm(
        xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16
    )  # row-wise scaling produces bfloat16 only
    out = out.to(x.dtype)
    return out if bias is None else out + bias


def dequantize_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 weight [N, K] with one scale per block[0] x block[1] tile -> float32 [N, K]."""
    n, k = weight.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return weight.float() * s


@triton.jit
def _block_fp8_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, M, N, K, stride_am, stride_asm, stride_bn, stride_bsn, stride_om,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_am + (k + offs_k)[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + offs_n[:, None] * stride_bn + (k + offs_k)[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        a_s = tl.load(as_ptr + offs_m * stride_asm + k // BLOCK_K, mask=m_mask, other=0.0)
        b_s = tl.load(bs_ptr + (offs_n // BLOCK_SIZE_N) * stride_bsn + k // BLOCK_K, mask=n_mask, other=0.0)
        if INTERPRET:
            part = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(a, tl.trans(b))
        acc += part * a_s[:, None] * b_s[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])  # fmt: skip


def block_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] (16-bit) @ W^T with W fp8 [N, K] scaled per block (block[1] = 128 along K, the
    activations' group): activations quantized per (token, 128 columns), then one Triton GEMM."""
    from kvllm.layers.ops.common import interpreting

    m, k = x.shape
    n = weight.shape[0]
    if block[1] != 128 or block[0] % 16 or weight.shape[1] != k or weight.dtype != FP8:
        raise ValueError(
            f"block fp8 needs an fp8 weight [N, {k}] with blocks [n, 128] (n a multiple of 16), got "
            f"{tuple(weight.shape)} {weight.dtype} blocks {block}"
        )
    xq, x_scale = quantize_fp8(x, 128)
    if m >= BLOCKWISE_MIN_ROWS and block == (128, 128) and n % 128 == 0 and k % 128 == 0:
        out = _scaled_mm_blockwise(xq, x_scale, weight, scale_inv, x.dtype)
        if out is not None:
            return out if bias is None else out + bias
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 64 if m <= 64 else 128
    block_n = 64 if m <= 64 else 128
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _block_fp8_kernel[grid](
        xq, x_scale, weight, scale_inv, out, m, n, k,
        xq.stride(0), x_scale.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0),
        BLOCK_SIZE_N=block[0], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, INTERPRET=interpreting(),
        num_warps=4 if block_m <= 64 else 8, num_stages=3,
    )  # fmt: skip
    return out if bias is None else out + bias


def _scaled_mm_blockwise(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """xq @ weight^T through F.scaled_mm with 1x128 (activations, scales M-major) and 128x128 (weight,
    its [N/128, K/128] scales transposed) block scales; None where this torch, GPU or input has none
    (the layouts are the ones the H200 probe found to run and match float32)."""
    scaling = getattr(F, "ScalingType", None)
    if scaling is None or not xq.is_cuda or scale_inv.dtype != torch.float32 or dtype != torch.bfloat16:
        return None
    try:
        return F.scaled_mm(
            xq, weight.t(), x_scale.t().contiguous().t(), scaling.BlockWise1x128,
            scale_inv.t(), scaling.BlockWise128x128, output_dtype=dtype,
        )  # fmt: skip
    except (RuntimeError, ValueError):  # a layout or shape this torch's kernels do not take
        return None
