"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, what llm-compressor writes),
mapped onto kvllm's kernels: W4A16 `pack-quantized` (int4, symmetric or with zero points, group or
channel, act order by `weight_g_idx`) onto the W4A16 kernel, and fp8 W8A8 `float-quantized`
(per-tensor, per-channel or block weight scales; dynamic per-token or static per-tensor activations)
onto the fp8 method.

pack-quantized tensors per layer: `weight_packed` [N, K/8] int32 (signed values + 8, value k % 8 in
bits 4 * (k % 8): already the kvllm int4 layout), `weight_scale` [N, K/G], `weight_zero_point`
[N/8, K/G] packed along the output (asymmetric only), `weight_shape` [2]; W = (q - zp) * scale.
One quantization scheme per model; other schemes (int8 W8A8, nvfp4, 2:4 sparsity) are errors.
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
    replace_parameter,
)
from kvllm.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod, _dummy_fp8, _dummy_scale
from kvllm.layers.quantization.int4 import (
    Int4LinearMethod,
    act_order_perm,
    check_group_size,
    check_packable,
    random_int32,
    random_scales,
)
from kvllm.layers.quantization.ops.fp8 import FP8
from kvllm.layers.quantization.ops.int4_layout import PACK, unpack_int4

_FORMATS = ("pack-quantized", "float-quantized", "naive-quantized")


def _scheme_error(detail: str) -> ValueError:
    return ValueError(
        f"compressed-tensors {detail} is not available in kvllm; it has W4A16 pack-quantized (int4 weights, "
        "group or channel) and fp8 W8A8 float-quantized (tensor, channel or block weights)"
    )


class CompressedTensorsConfig(QuantizationConfig):
    """One compressed-tensors scheme for every Linear, minus the `ignore` list."""

    name = "compressed-tensors"

    def __init__(
        self, weights: dict[str, Any], activations: dict[str, Any] | None, ignore: list[str]
    ) -> None:
        self.weights = weights
        self.activations = activations
        self.ignore = ignore
        self.is_w4a16 = weights.get("type", "int") == "int"
        if self.is_w4a16:
            self.group_size = (
                int(weights.get("group_size") or -1) if weights.get("strategy") == "group" else -1
            )
            self.symmetric = bool(weights.get("symmetric", True))
        else:
            strategy = weights.get("strategy")
            block = tuple(weights["block_structure"]) if strategy == "block" else None
            static = bool(activations) and not activations.get("dynamic", True)  # type: ignore[union-attr]
            self.fp8 = Fp8Config(static_activations=static, weight_block_size=block)  # type: ignore[arg-type]
            self.fp8_strategy = strategy

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        groups = list((config.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise _scheme_error(f"with {len(groups)} config groups (one scheme for all layers)")
        group = groups[0]
        if [t for t in group.get("targets", []) if t not in ("Linear", "re:.*")]:
            raise _scheme_error(f"targets {group.get('targets')} (kvllm applies a scheme to every Linear)")
        fmt = group.get("format") or config.get("format")
        if fmt not in _FORMATS:
            raise _scheme_error(f"format {fmt!r}")
        if config.get("sparsity_config"):
            raise _scheme_error("sparsity (sparsity_config)")
        weights = group.get("weights") or {}
        activations = group.get("input_activations")
        bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
        if kind == "int" and bits == 4 and not activations and fmt == "pack-quantized":
            if strategy not in ("group", "channel"):
                raise _scheme_error(f"W4A16 with strategy {strategy!r}")
            if weights.get("actorder") not in (None, "group", "weight", "static", "dynamic"):
                raise _scheme_error(f"actorder {weights.get('actorder')!r}")
        elif kind == "float" and bits == 8 and fmt in ("float-quantized", "naive-quantized"):
            if strategy not in ("tensor", "channel", "block"):
                raise _scheme_error(f"fp8 weights with strategy {strategy!r}")
            if strategy == "block" and list(weights.get("block_structure", [])) != [128, 128]:
                raise _scheme_error(f"fp8 blocks {weights.get('block_structure')}")
            if activations and (activations.get("type") != "float" or activations.get("num_bits") != 8):
                raise _scheme_error(f"fp8 weights with activations {activations}")
        else:
            act = f"{activations.get('type')}{activations.get('num_bits')}" if activations else "16-bit"
            raise _scheme_error(f"scheme {kind}{bits} weights / {act} activations, format {fmt!r}")
        return cls(weights, activations, list(config.get("ignore") or []))

    def get_linear_method(self, prefixes: list[str]) -> LinearMethodBase:
        if layer_is_ignored(prefixes, self.ignore):
            return UnquantizedLinearMethod()
        if self.is_w4a16:
            return CompressedTensorsW4A16(
                self.group_size, self.symmetric, self.weights.get("actorder") == "group"
            )
        return CompressedTensorsW8A8Fp8(self.fp8, self.fp8_strategy)

    def describe(self) -> str:
        if self.is_w4a16:
            kind = "symmetric" if self.symmetric else "with zero points"
            return f"compressed-tensors W4A16 (pack-quantized, group size {self.group_size}, {kind})"
        return f"compressed-tensors fp8 W8A8 ({self.fp8_strategy} weight scales) as {self.fp8.describe()}"


class CompressedTensorsW4A16(Int4LinearMethod):
    """pack-quantized int4 weights on the W4A16 kernel."""

    def __init__(self, group_size: int, symmetric: bool, has_g_idx: bool) -> None:
        super().__init__(group_size)
        self.symmetric = symmetric
        self.has_g_idx = has_g_idx

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        check_packable(input_size, output_sizes, "compressed-tensors W4A16")
        group = check_group_size(self.group_size, input_size, "compressed-tensors W4A16")
        n, groups = sum(output_sizes), input_size // group
        new_parameter(
            layer, "weight_packed", (n, input_size // PACK), torch.int32, 0, dummy_init=random_int32
        )
        new_parameter(layer, "weight_scale", (n, groups), params_dtype, 0, dummy_init=random_scales)
        new_parameter(layer, "weight_shape", (len(output_sizes), 2), torch.int64, None, per_shard=True,
                      dummy_init=lambda p, g: p.copy_(torch.tensor([[s, input_size] for s in output_sizes])))  # fmt: skip
        if not self.symmetric:
            new_parameter(
                layer, "weight_zero_point", (n // PACK, groups), torch.int32, 0, PACK, dummy_init=random_int32
            )
        if self.has_g_idx:

            def sequential_groups(param: torch.Tensor, generator: torch.Generator) -> None:
                param.copy_(torch.arange(input_size, device=param.device) // group)

            new_parameter(
                layer, "weight_g_idx", (input_size,), torch.int32, None, dummy_init=sequential_groups
            )

    def to_kvllm_layout(
        self, layer: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        expected = [[size, layer.in_features] for size in layer.output_sizes]
        if layer.weight_shape.tolist() != expected:
            raise ValueError(
                f"{layer.prefix}: weight_shape {layer.weight_shape.tolist()} != the layer's {expected}"
            )
        scales = layer.weight_scale
        if self.symmetric:
            zeros = torch.full_like(scales, 8)
        else:
            zeros = unpack_int4(layer.weight_zero_point.t().contiguous()).t().to(scales.dtype)
        values = unpack_int4(layer.weight_packed)
        perm = (
            act_order_perm(layer.weight_g_idx, self.layer_group_size(layer), layer.prefix)
            if self.has_g_idx
            else None
        )
        if perm is not None:
            values = values.index_select(1, perm)
        return values, scales, zeros, perm


class CompressedTensorsW8A8Fp8(Fp8LinearMethod):
    """float-quantized fp8 weights; scales renamed into the fp8 method's layout after loading."""

    def __init__(self, config: Fp8Config, strategy: str) -> None:
        super().__init__(config)
        self.strategy = strategy

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        n, shards = sum(output_sizes), len(output_sizes)
        new_parameter(layer, "weight", (n, input_size), FP8, 0, dummy_init=_dummy_fp8)
        if self.strategy == "channel":
            new_parameter(layer, "weight_scale", (n, 1), torch.float32, 0, dummy_init=_dummy_scale)
        elif self.strategy == "block":
            shape = (-(-n // 128), -(-input_size // 128))
            new_parameter(layer, "weight_scale", shape, torch.float32, 0, 128, dummy_init=_dummy_scale)
        else:
            new_parameter(
                layer, "weight_scale", (shards,), torch.float32, None, per_shard=True, dummy_init=_dummy_scale
            )
        if self.config.static_activations:
            new_parameter(
                layer, "input_scale", (shards,), torch.float32, None, per_shard=True, dummy_init=_dummy_scale
            )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.strategy == "channel":
            replace_parameter(layer, "weight_scale", layer.weight_scale.data.view(-1))
            if self.config.static_activations:
                replace_parameter(layer, "input_scale", layer.input_scale.data.max().reshape(1))
        elif self.strategy == "block":
            layer.register_parameter(
                "weight_scale_inv", nn.Parameter(layer.weight_scale.data, requires_grad=False)
            )
            delattr(layer, "weight_scale")
        else:
            super().process_weights_after_loading(layer)
