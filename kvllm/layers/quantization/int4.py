"""What the 4-bit weight-only methods (AWQ, GPTQ, compressed-tensors W4A16) share: repacking into the
kvllm int4 layout (kvllm/layers/quantization/ops/int4_layout.py), dummy values, `apply` and the fused
gate_up activation."""

from __future__ import annotations

import torch
from torch import nn

from kvllm.layers.quantization.base import LinearMethodBase
from kvllm.layers.quantization.ops.int4_layout import PACK, pack_kernel_layout, unpack_int4
from kvllm.layers.quantization.ops.w4a16 import w4a16_linear, w4a16_silu_and_mul

DUMMY_SCALE = 0.003  # dequantized weights (q - z) * s then have a spread of about 0.02, as dummy bf16 ones


def random_int32(param: torch.Tensor, generator: torch.Generator) -> None:
    """Every bit random: eight random 4-bit values per word."""
    param.copy_(torch.randint(-(2**31), 2**31, param.shape, generator=generator, device=param.device))


def random_scales(param: torch.Tensor, generator: torch.Generator) -> None:
    values = torch.rand(param.shape, generator=generator, device=param.device, dtype=torch.float32)
    param.copy_((0.5 + values) * DUMMY_SCALE)


def check_group_size(group_size: int, input_size: int, method: str) -> int:
    """The group size a layer of `input_size` inputs runs with (-1: one group, per output channel)."""
    if group_size == -1:
        return input_size
    if group_size <= 0 or input_size % group_size:
        raise ValueError(f"{method}: input size {input_size} is not a multiple of group_size {group_size}")
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(
            f"{method}: group_size {group_size} is not available; kvllm has -1 and powers of two >= 16"
        )
    return group_size


def check_packable(input_size: int, output_sizes: list[int], method: str) -> None:
    if input_size % PACK or any(size % PACK for size in output_sizes):
        raise ValueError(
            f"{method}: 4-bit layers need input and output sizes that are multiples of {PACK}, got input "
            f"{input_size} and outputs {output_sizes}"
        )


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R / 8, C] int32 packed along rows (GPTQ's qweight) -> [R, C] values."""
    return unpack_int4(packed.t().contiguous()).t()


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, C / 8] int32 in AWQ's order (word j holds columns 8j + (0, 2, 4, 6, 1, 3, 5, 7) in nibbles
    0..7) -> [R, C] values in column order."""
    nibbles = unpack_int4(packed).reshape(packed.shape[0], -1, PACK)
    reverse = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7], device=packed.device)
    return nibbles.index_select(2, reverse).reshape(packed.shape[0], -1)


def act_order_perm(g_idx: torch.Tensor, group: int, prefix: str) -> torch.Tensor | None:
    """The permutation of input rows that makes act-order groups contiguous (None when they are)."""
    g_idx = g_idx.long()
    sequential = torch.arange(g_idx.numel(), device=g_idx.device) // group
    if torch.equal(g_idx, sequential):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], sequential):
        raise ValueError(f"{prefix}: g_idx does not put {group} input rows in each group")
    return perm


class Int4LinearMethod(LinearMethodBase):
    """A 4-bit weight with per-group scales and zero points, run by the W4A16 kernel. Subclasses create
    the checkpoint's tensors and convert them in `to_kvllm_layout`."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size  # -1: per output channel

    def layer_group_size(self, layer: nn.Module) -> int:
        return layer.in_features if self.group_size == -1 else self.group_size

    def to_kvllm_layout(
        self, layer: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(values [N, K] in 0..15, scales [N, K/G], zeros [N, K/G], perm [K] or None) of the layer."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        values, scales, zeros, perm = self.to_kvllm_layout(layer)
        dtype = scales.dtype
        for name in [name for name, _ in layer.named_parameters(recurse=False) if name != "bias"]:
            delattr(layer, name)
        for name, value in (
            ("qweight", pack_kernel_layout(values)),
            ("scales", scales),
            ("zeros", zeros.to(dtype)),
        ):
            layer.register_parameter(name, nn.Parameter(value.contiguous(), requires_grad=False))
        layer.register_buffer("perm", perm, persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return w4a16_linear(
            x, layer.qweight, layer.scales, layer.zeros, self.layer_group_size(layer), bias, layer.perm
        )

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        return w4a16_silu_and_mul(
            x, layer.qweight, layer.scales, layer.zeros, self.layer_group_size(layer), bias, layer.perm
        )
