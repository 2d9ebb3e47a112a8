"""GPTQ checkpoints (`quant_method: gptq`): 4-bit weights with per-group scales and zero points,
symmetric or not, optionally in activation order (desc_act).

Tensors per layer (K inputs, N outputs, G the group size): `qweight` [K/8, N] int32 packed along the
input (value k % 8 in bits 4 * (k % 8)), `qzeros` [K/G, N/8] packed along the output, `scales` [K/G, N]
and `g_idx` [K], the group of each input row (act order: rows sorted by importance, so a group's rows
are scattered). W^T[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n], with z the stored zero plus
one in the original format (`checkpoint_format: gptq`; gptq_v2 stores z itself).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvllm.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    new_parameter,
)
from kvllm.layers.quantization.int4 import (
    Int4LinearMethod,
    act_order_perm,
    check_group_size,
    check_packable,
    random_int32,
    random_scales,
    unpack_int4_rows,
)
from kvllm.layers.quantization.ops.int4_layout import PACK, unpack_int4


class GPTQConfig(QuantizationConfig):
    """GPTQ: 4 bits, group size (-1: per channel), desc_act, sym, and the zero-point convention."""

    name = "gptq"

    def __init__(self, group_size: int, desc_act: bool, sym: bool, zero_plus_one: bool) -> None:
        self.group_size = group_size
        self.desc_act = desc_act
        self.sym = sym
        self.zero_plus_one = zero_plus_one

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        bits = config.get("bits", 4)
        if bits != 4:
            raise ValueError(f"GPTQ with {bits} bits is not available; kvllm runs 4-bit GPTQ")
        if config.get("lm_head", False):
            raise ValueError(
                "GPTQ with a quantized lm_head (lm_head: true) is not available; kvllm keeps the head dense"
            )
        if config.get("dynamic"):
            raise ValueError("GPTQ per-module overrides (`dynamic`) are not available in kvllm")
        fmt = str(config.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"GPTQ checkpoint_format {fmt!r} is not available; kvllm reads 'gptq' and 'gptq_v2'"
            )
        if config.get("is_marlin_format", False):
            raise ValueError(
                "GPTQ checkpoints in Marlin's packing (is_marlin_format) are not available in kvllm"
            )
        return cls(
            int(config.get("group_size", 128)),
            bool(config.get("desc_act", False)),
            bool(config.get("sym", True)),
            zero_plus_one=fmt == "gptq",
        )

    def get_linear_method(self, prefixes: list[str]) -> LinearMethodBase:
        return GPTQLinearMethod(self.group_size, self.zero_plus_one)  # GPTQ quantizes every decoder linear

    def describe(self) -> str:
        order = ", act order" if self.desc_act else ""
        kind = "symmetric" if self.sym else "asymmetric"
        return f"gptq (4-bit, group size {self.group_size}, {kind}{order})"


class GPTQLinearMethod(Int4LinearMethod):
    """GPTQ's tensors; act order becomes a permutation of the input rows after loading."""

    def __init__(self, group_size: int, zero_plus_one: bool) -> None:
        super().__init__(group_size)
        self.zero_plus_one = zero_plus_one

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        check_packable(input_size, output_sizes, "GPTQ")
        group = check_group_size(self.group_size, input_size, "GPTQ")
        groups, n = input_size // group, sum(output_sizes)

        def sequential_groups(param: torch.Tensor, generator: torch.Generator) -> None:
            param.copy_(torch.arange(input_size, device=param.device) // group)

        # Tensor parallel: rows along the input; one group (group_size -1) is shared by every rank.
        group_dim = None if self.group_size == -1 else 0
        grouped = {"input_dim": group_dim, "input_divisor": max(self.group_size, 1)}
        new_parameter(
            layer, "qweight", (input_size // PACK, n), torch.int32, 1, dummy_init=random_int32,
            input_dim=0, input_divisor=PACK,
        )  # fmt: skip
        new_parameter(
            layer, "qzeros", (groups, n // PACK), torch.int32, 1, PACK, dummy_init=random_int32, **grouped
        )
        new_parameter(layer, "scales", (groups, n), params_dtype, 1, dummy_init=random_scales, **grouped)
        # One g_idx for all shards: act order sorts rows by the input's statistics, which the shards share.
        # Split along the input (tensor parallel) a rank's rows keep their global group numbers.
        new_parameter(
            layer, "g_idx", (input_size,), torch.int32, None, dummy_init=sequential_groups, input_dim=0
        )

    def to_kvllm_layout(
        self, layer: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        group = self.layer_group_size(layer)
        values = unpack_int4_rows(layer.qweight)  # [K, N]
        zeros = unpack_int4(layer.qzeros).to(layer.scales.dtype) + (1 if self.zero_plus_one else 0)
        # A row-parallel rank's groups start at its first row's group (act order across ranks: the
        # check below names the layer).
        perm = act_order_perm(layer.g_idx - layer.g_idx.min(), group, layer.prefix)
        if perm is not None:
            values = values.index_select(0, perm)
        return values.t(), layer.scales.t(), zeros.t(), perm
