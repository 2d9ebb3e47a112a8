"""What the fused kernels share: rounding as torch's elementwise ops round, and row views of inputs.

torch computes a 16-bit elementwise op in float32 and rounds the result to the tensor's dtype (to
nearest, ties to even). The kernels keep values in float32 and call `round_to` at each point where the
eager code would have produced a 16-bit tensor.

Under the Triton interpreter (INTERPRET, from `interpreting()`) a float32 -> bfloat16 cast truncates
instead of rounding, so there the rounding is done on the bits; compiled kernels use the hardware's cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvllm.attention.ops.triton_reshape_and_cache import _interpreting


def interpreting() -> bool:
    """The INTERPRET argument of the helpers below: True when kernels run in the Triton interpreter."""
    return _interpreting()


def as_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """t [..., n] as a [rows, n] view with a contiguous last dimension, for a kernel's row loop."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension, got strides {tuple(t.stride())}")
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as exc:
        raise ValueError(f"{name} of shape {tuple(t.shape)} and strides {tuple(t.stride())} cannot be "
                         "viewed as rows; make it contiguous") from exc  # fmt: skip


@triton.jit
def _bf16_rne_bits(x):
    # Add half an ulp of bfloat16 (less one, plus the kept lowest bit: ties go to even), then drop the
    # low 16 bits. Exact for every finite value, subnormals and signed zeros included.
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 x rounded to the nearest DTYPE value (ties to even), returned as float32."""
    if DTYPE == tl.float32:
        y = x
    elif INTERPRET and DTYPE == tl.bfloat16:
        y = _bf16_rne_bits(x)
    else:
        y = x.to(DTYPE).to(tl.float32)
    return y


@triton.jit
def cast_to(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 x cast to DTYPE, rounding to nearest even (what a store of a torch result holds)."""
    if INTERPRET and DTYPE == tl.bfloat16:
        y = _bf16_rne_bits(x).to(DTYPE)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def exp_f32(x, INTERPRET: tl.constexpr):
    """expf as CUDA's libdevice computes it (what torch's kernels call); numpy's exp in the interpreter.

    tl.exp lowers to an approximate base-2 exponential on NVIDIA GPUs.
    """
    if INTERPRET:
        y = tl.exp(x)
    else:
        y = libdevice.exp(x)
    return y


@triton.jit
def gated_silu(gate, up, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """silu(gate) * up from float32 gate and up, rounded where torch's unfused path rounds: gate and up
    to DTYPE (the projection's output), silu as g / (1 + exp(-g)) (IEEE division, libdevice expf) to
    DTYPE; the product is left in float32 for the caller's cast."""
    gate = round_to(gate, DTYPE, INTERPRET)
    up = round_to(up, DTYPE, INTERPRET)
    return round_to(tl.math.div_rn(gate, 1.0 + exp_f32(-gate, INTERPRET)), DTYPE, INTERPRET) * up


@triton.jit
def mma_dot(a, b, acc, INTERPRET: tl.constexpr):
    """a @ b (+ acc, or none when acc is None) in float32, of 16-bit tiles. The interpreter's 16-bit dots are
    unreliable; there the values are widened first (their float32 products are exact, as the MMA's are)."""
    if INTERPRET:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        if acc is None:
            acc = tl.dot(a, b, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc, input_precision="ieee")
    elif acc is None:
        acc = tl.dot(a, b)
    else:
        acc = tl.dot(a, b, acc)
    return acc
