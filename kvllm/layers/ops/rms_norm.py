"""RMSNorm, and residual add + RMSNorm, in one Triton launch each.

Reference: `kvllm.layers.norm.RMSNorm` (torch). The kernel rounds where the eager ops do: the residual
sum to the activation dtype; the mean of squares, rsqrt and normalisation in float32, rounded to the
activation dtype; the weight product rounded to the output dtype (torch's promotion of weight and
activation dtypes). Results differ from the eager path only by float32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvllm.layers.ops.common import as_rows, cast_to, interpreting, round_to
from kvllm.utils.pdl import pdl_enabled, pdl_launch_options, wait_for_previous_kernel

MAX_HIDDEN_SIZE = 65536  # one row lives in registers of one program


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    HIDDEN_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN_SIZE
    act_dtype = x_ptr.dtype.element_ty
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a parameter: before the wait
    wait_for_previous_kernel(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = round_to(x + r, act_dtype, INTERPRET)
        # The whole row is loaded before any store, so the outputs may alias the inputs.
        tl.store(residual_out_ptr + row * stride_ro + cols, x.to(act_dtype), mask=mask)
    mean_square = tl.math.div_rn(tl.sum(x * x, axis=0), HIDDEN_SIZE * 1.0)
    normed = round_to(x * tl.math.rsqrt(mean_square + eps), act_dtype, INTERPRET)
    # For 16-bit operands the float32 product is exact, so rounding it once is torch's 16-bit multiply.
    y = cast_to(normed * w, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
) -> None:
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [{hidden_size}] tensor, got {tuple(weight.shape)}")
    if hidden_size > MAX_HIDDEN_SIZE:
        raise ValueError(f"hidden size {hidden_size} is above the kernel's limit of {MAX_HIDDEN_SIZE}")
    if out.shape != x.shape or (residual_out is not None and residual_out.shape != x.shape):
        raise ValueError(f"outputs must have x's shape {tuple(x.shape)}")
    x2 = as_rows(x, "x")
    num_rows = x2.shape[0]
    if num_rows == 0:
        return
    out2 = as_rows(out, "out")
    r2 = ro2 = x2  # unused unless HAS_RESIDUAL
    if residual is not None and residual_out is not None:
        r2, ro2 = as_rows(residual, "residual"), as_rows(residual_out, "residual_out")
    block = triton.next_power_of_2(hidden_size)
    use_pdl = pdl_enabled(x)
    _rms_norm_kernel[(num_rows,)](
        x2, r2, weight, out2, ro2,
        x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0),
        eps,
        HIDDEN_SIZE=hidden_size,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        USE_PDL=use_pdl,
        INTERPRET=interpreting(),
        num_warps=min(16, max(4, block // 512)),
        enable_fp_fusion=False,
        **pdl_launch_options(use_pdl),
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dimension of x ([..., hidden]) into `out` (new unless given; may be x).
    `weight` is a layer's parameter: under PDL it loads before the previous kernel has finished.

    The result's dtype is torch's promotion of x's and weight's dtypes, as in the eager layer.
    """
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual), the sum rounded to x's dtype, in one launch.

    Outputs go to `out` and `residual_out`, new tensors unless given; passing `out=x,
    residual_out=residual` makes it in place.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
        )
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual_out is None:
        residual_out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out
