"""The kvllm int4 weight layout that the W4A16 kernels read, and the plain-torch helpers around it.

`qweight` [N, K/8] int32: each output column's 4-bit values are contiguous along K, eight to a word,
so a column is one stream of K/2 bytes. Within a column, K is cut into blocks of 8 * B values (B =
`block_words(K)` words: 16 when K is a multiple of 128); word b of a block holds the block's values
j * B + b in nibble j (bits 4j .. 4j + 3), j = 0..7. For a kernel that decodes nibble j of B
consecutive words at once, the matching activations x[j * B + b] are then B consecutive elements (one
vector load) rather than a stride-8 gather. `scales` and `zeros` are [N, K/G] in the activations' dtype;
W[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G].

`pack_int4` / `unpack_int4` are the plain sequential packing (value c % 8 of each word in nibble c % 8,
compressed-tensors' order) that the checkpoint formats' converters use; `pack_kernel_layout` /
`unpack_kernel_layout` add the block permutation on top.
"""

from __future__ import annotations

import torch

PACK = 8  # 4-bit values per int32
MAX_BLOCK_WORDS = 16  # words per block: 128 values, the usual group size


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[R, C] integers in [0, 15] -> [R, C / 8] int32, value c % 8 of each word in bits 4 * (c % 8)."""
    if values.shape[-1] % PACK:
        raise ValueError(f"int4 packing needs a multiple of {PACK} columns, got {values.shape[-1]}")
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, PACK)
    shifts = torch.arange(PACK, dtype=torch.int64, device=values.device) * 4
    words = (v << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: [R, C / 8] int32 -> [R, C] uint8 values in [0, 15]."""
    shifts = torch.arange(PACK, dtype=torch.int32, device=packed.device) * 4
    values = (packed.unsqueeze(-1) >> shifts) & 0xF
    return values.reshape(*packed.shape[:-1], -1).to(torch.uint8)


def block_words(k: int) -> int:
    """B, the words per block of the layout for K inputs: 16, or the largest power of two dividing K / 8
    when K is not a multiple of 128."""
    if k % PACK or k <= 0:
        raise ValueError(f"the int4 layout needs K to be a positive multiple of {PACK}, got {k}")
    words = MAX_BLOCK_WORDS
    while (k // PACK) % words:
        words //= 2
    return words


def _blocked(values: torch.Tensor) -> torch.Tensor:
    """[N, K] as [N, K / (8B), 8, B]: (block, nibble j, word b)."""
    n, k = values.shape
    words = block_words(k)
    return values.reshape(n, k // (PACK * words), PACK, words)


def pack_kernel_layout(values: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in [0, 15] in K order -> the kernels' qweight [N, K/8] int32."""
    if values.dim() != 2:
        raise ValueError(f"expected values [N, K], got {tuple(values.shape)}")
    n, k = values.shape
    # Sequential packing of the (block, word b, nibble j) order puts value j * B + b in nibble j of word b.
    return pack_int4(_blocked(values).transpose(2, 3).reshape(n, k))


def unpack_kernel_layout(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_kernel_layout`: qweight [N, K/8] -> [N, K] uint8 values in K order."""
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    words = block_words(k)
    sequential = unpack_int4(qweight).reshape(n, k // (PACK * words), words, PACK)
    return sequential.transpose(2, 3).reshape(n, k)


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The float32 weight [N, K] of the kvllm int4 layout (the reference of every W4A16 path)."""
    q = unpack_kernel_layout(qweight).float()
    s = scales.float().repeat_interleave(group_size, dim=1)[:, : q.shape[1]]
    z = zeros.float().repeat_interleave(group_size, dim=1)[:, : q.shape[1]]
    return (q - z) * s
