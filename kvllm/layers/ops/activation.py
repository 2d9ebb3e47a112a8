"""silu(gate) * up over a fused gate_up projection, in one Triton launch.

Reference: `kvllm.layers.activation.SiluAndMul` (torch): silu computed in float32 as
g / (1 + exp(-g)) (IEEE division, libdevice expf) and rounded to the activation dtype, then the
product with `up` rounded once, as torch's two elementwise kernels do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvllm.layers.ops.common import as_rows, cast_to, gated_silu, interpreting

MAX_BLOCK = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    # gate and up are DTYPE values already: gated_silu's rounding of them changes nothing
    tl.store(
        out_ptr + row * stride_o + cols,
        cast_to(gated_silu(gate, up, dtype, INTERPRET), dtype, INTERPRET),
        mask=mask,
    )


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2 * d] (gate then up) -> silu(gate) * up [..., d], into `out` (new unless given)."""
    if x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(
            f"silu_and_mul needs x as [..., 2 * d] with a contiguous last dimension, got shape "
            f"{tuple(x.shape)} strides {tuple(x.stride())}"
        )
    d = x.shape[-1] // 2
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    elif out.shape != (*x.shape[:-1], d) or out.dtype != x.dtype:
        raise ValueError(
            f"out must be a {(*x.shape[:-1], d)} {x.dtype} tensor, got {tuple(out.shape)} {out.dtype}"
        )
    x2, out2 = as_rows(x, "x"), as_rows(out, "out")
    if x2.shape[0] == 0:
        return out
    block = min(MAX_BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
        x2, out2, x2.stride(0), out2.stride(0),
        D=d,
        BLOCK=block,
        INTERPRET=interpreting(),
        num_warps=4,
        enable_fp_fusion=False,
    )  # fmt: skip
    return out
