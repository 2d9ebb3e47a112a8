"""One-pass sampling from logits: argmax(logits / T + Gumbel noise), greedy rows argmax(logits).

argmax(log p + G) with G ~ Gumbel(0, 1) i.i.d. is a draw from p (the Gumbel-max trick, the same
exact race as the sampler's p / Exp(1)); with log p = logits / T - log Z the normaliser drops out,
so no softmax is computed: the kernel reads each row of logits once, in the model's dtype, and
writes one token id. The noise is Philox (`tl.rand`) keyed by a per-step seed and the element's
position, so it needs no state on the device. Used for rows without top-k / top-p / min-p and
without a per-request seed; the sampler keeps the torch path for everything else.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit(do_not_specialize=["seed"])  # a new seed every step: one compiled variant for all
def _gumbel_argmax_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    is_greedy_ptr,
    out_ptr,
    vocab_size,
    seed,
    HAS_TEMPERATURE: tl.constexpr,
    HAS_GREEDY: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    inv_t = 1.0
    if HAS_TEMPERATURE:
        inv_t = 1.0 / tl.load(temperature_ptr + row).to(tl.float32)
    greedy = ALL_GREEDY
    if HAS_GREEDY:
        greedy = tl.load(is_greedy_ptr + row) != 0
    base = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_vocab = offs < vocab_size
        x = tl.load(base + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
        if not greedy:
            u = tl.rand(seed, row * vocab_size + offs)
            # -log(-log(u)): u = 0 gives -inf (never chosen), never NaN.
            x = x * inv_t - tl.log(-tl.log(u))
            x = tl.where(in_vocab, x, float("-inf"))
        block_best = tl.max(x, axis=0)
        block_index = tl.argmax(x, axis=0)
        # Strictly greater: on ties the first index wins, as torch.argmax.
        better = block_best > best
        best_index = tl.where(better, start + block_index, best_index)
        best = tl.where(better, block_best, best)
    tl.store(out_ptr + row, best_index.to(tl.int64))


def gumbel_sample(
    logits: torch.Tensor,  # [N, V], any float dtype, last dim contiguous
    temperature: torch.Tensor | None,  # float32 [N]; None = 1 for every row
    is_greedy: torch.Tensor | None,  # bool [N]; None = every row random (or all_greedy)
    seed: int,
    all_greedy: bool = False,
) -> torch.Tensor:
    """One token id per row (int64 [N]): greedy rows argmax, the others a draw from softmax(logits / T)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [N, V] with a contiguous last dimension, got {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    dummy = out
    _gumbel_argmax_kernel[(num_rows,)](
        logits,
        logits.stride(0),
        temperature if temperature is not None else dummy,
        is_greedy.view(torch.uint8) if is_greedy is not None else dummy,
        out,
        vocab_size,
        seed,
        HAS_TEMPERATURE=temperature is not None,
        HAS_GREEDY=is_greedy is not None,
        ALL_GREEDY=all_greedy,
        BLOCK=BLOCK_V,
        num_warps=8,
    )
    return out
