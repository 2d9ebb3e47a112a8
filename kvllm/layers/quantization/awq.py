"""AWQ checkpoints (AutoAWQ's GEMM format, `quant_method: awq`, `version: gemm`): 4-bit weights with a
zero point per group.

Tensors per layer (K inputs, N outputs, G the group size): `qweight` [K, N/8] int32 packed along the
output in AWQ's interleaved order (kvllm/layers/quantization/int4.py `awq_unpack`), `qzeros` [K/G, N/8]
packed the same way, `scales` [K/G, N]; W^T[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n].
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvllm.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    UnquantizedLinearMethod,
    layer_is_ignored,
    new_parameter,
)
from kvllm.layers.quantization.int4 import (
    Int4LinearMethod,
    awq_unpack,
    check_group_size,
    check_packable,
    random_int32,
    random_scales,
)
from kvllm.layers.quantization.ops.int4_layout import PACK


class AWQConfig(QuantizationConfig):
    """AWQ: 4 bits, a group size, zero points; layers in `modules_to_not_convert` stay unquantized."""

    name = "awq"

    def __init__(self, group_size: int, modules_to_not_convert: list[str] | None = None) -> None:
        self.group_size = group_size
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        bits = config.get("bits", config.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"AWQ with {bits} bits is not available; kvllm runs 4-bit AWQ")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"AWQ version {version!r} is not available; kvllm reads AutoAWQ's GEMM format (version 'gemm')"
            )
        if not config.get("zero_point", True):
            raise ValueError(
                "AWQ without zero points (zero_point: false) is not available; kvllm has zero_point true"
            )
        group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        return cls(group_size, config.get("modules_to_not_convert"))

    def get_linear_method(self, prefixes: list[str]) -> LinearMethodBase:
        if layer_is_ignored(prefixes, self.modules_to_not_convert):
            return UnquantizedLinearMethod()
        return AWQLinearMethod(self.group_size)

    def describe(self) -> str:
        return f"awq (4-bit GEMM format, group size {self.group_size}, zero points)"


class AWQLinearMethod(Int4LinearMethod):
    """AWQ's tensors, repacked for the W4A16 kernel after loading."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        check_packable(input_size, output_sizes, "AWQ")
        groups = input_size // check_group_size(self.group_size, input_size, "AWQ")
        n = sum(output_sizes)
        # Tensor parallel: rows along the input; one group (group_size -1) is shared by every rank.
        group_dim = None if self.group_size == -1 else 0
        group = {"input_dim": group_dim, "input_divisor": max(self.group_size, 1)}
        new_parameter(
            layer,
            "qweight",
            (input_size, n // PACK),
            torch.int32,
            1,
            PACK,
            dummy_init=random_int32,
            input_dim=0,
        )
        new_parameter(
            layer, "qzeros", (groups, n // PACK), torch.int32, 1, PACK, dummy_init=random_int32, **group
        )
        new_parameter(layer, "scales", (groups, n), params_dtype, 1, dummy_init=random_scales, **group)

    def to_kvllm_layout(
        self, layer: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        values = awq_unpack(layer.qweight).t()
        zeros = awq_unpack(layer.qzeros).t().to(layer.scales.dtype)
        return values, layer.scales.t(), zeros, None
