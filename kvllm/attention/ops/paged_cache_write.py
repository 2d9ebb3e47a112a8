"""Writing a step's new K/V rows into a paged cache of any stride, for backends over external kernels.

On CUDA this is the Triton write kernel (one launch, no host sync, fp8 rounding as torch's cast);
elsewhere, and for tensors Triton cannot take, it is torch indexing. The two agree bit for bit on
16-bit caches (tests/kernels/test_triton_kv_write.py runs both).
"""

from __future__ import annotations

import torch

_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    scale = _UNIT_SCALES.get(device)
    if scale is None:
        scale = _UNIT_SCALES[device] = torch.ones((), dtype=torch.float32, device=device)
    return scale


def write_kv_to_paged_cache(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], head dim contiguous
    value_cache: torch.Tensor,
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; -1 = skip
    k_scale: torch.Tensor | None = None,  # fp8 caches store K / k_scale
    v_scale: torch.Tensor | None = None,
    use_triton: bool | None = None,  # None: on CUDA tensors
) -> None:
    """Store each token's K/V at its slot (block * block_size + offset), skipping slot -1."""
    if use_triton is None:
        use_triton = key_cache.is_cuda
    if use_triton:
        from kvllm.attention.ops.triton_reshape_and_cache import reshape_and_cache

        one = _unit_scale(key_cache.device)
        reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping,
            one if k_scale is None else k_scale, one if v_scale is None else v_scale,
            num_tokens=key.shape[0],
        )  # fmt: skip
        return
    # Boolean masking costs one device sync; this path serves CPU tensors.
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key, value = key[valid], value[valid]
    if k_scale is not None:
        key = key.float() / k_scale
    if v_scale is not None:
        value = value.float() / v_scale
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)
