"""The quantization contract, as vLLM's: a QuantizationConfig (read from a checkpoint's
`quantization_config`, or asked for by `--quantization`) gives each linear layer a LinearMethod that
creates the layer's parameters, post-processes them once they are loaded, and computes the layer.

A parameter a method creates carries what the one loader in kvllm/layers/linear.py needs to put a
checkpoint tensor (one shard of a fused layer, or the whole layer) into it: `output_dim` (the
dimension along which shards are stacked, None for tensors all shards share), `output_divisor` (output
rows per element along that dimension: 8 for int4 values packed along the output, 128 for block scales)
and `per_shard` (one scalar per shard: per-tensor scales). Row-parallel layers (tensor parallel) also
need `input_dim` (the dimension along the layer's input, None for tensors that do not depend on it) and
`input_divisor` (inputs per element along it: 8 for int4 packed along the input, the group size for group
scales); a method that does not declare them cannot be split along the input, and a row-parallel layer
built with it at TP > 1 raises.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.layers.ops.dispatch import use_fused_ops

# new_parameter's input_dim when the method does not say how the tensor splits along the input.
NOT_DECLARED = object()

# fill(param, generator): random values for load_format=dummy that the layer can run on.
DummyInit = Callable[[torch.Tensor, torch.Generator], None]


def new_parameter(
    layer: nn.Module,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    output_dim: int | None,
    output_divisor: int = 1,
    per_shard: bool = False,
    dummy_init: DummyInit | None = None,
    input_dim: int | None | object = NOT_DECLARED,
    input_divisor: int = 1,
) -> nn.Parameter:
    """An uninitialised, frozen parameter registered on `layer` with the loader's attributes."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.output_dim = output_dim  # type: ignore[attr-defined]
    param.output_divisor = output_divisor  # type: ignore[attr-defined]
    param.per_shard = per_shard  # type: ignore[attr-defined]
    if input_dim is not NOT_DECLARED:
        param.input_dim = input_dim  # type: ignore[attr-defined]
        param.input_divisor = input_divisor  # type: ignore[attr-defined]
    if dummy_init is not None:
        param.dummy_init = dummy_init  # type: ignore[attr-defined]
    layer.register_parameter(name, param)
    return param


def replace_parameter(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    """Swap a parameter for a post-processed tensor (a new shape or dtype), kept frozen."""
    delattr(layer, name)
    layer.register_parameter(name, nn.Parameter(value, requires_grad=False))


class LinearMethodBase(ABC):
    """How one linear layer stores and applies its weight (vLLM's LinearMethodBase)."""

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        """Register the layer's weight parameters (not the bias) for an input of `input_size` and the
        shards `output_sizes` stacked along the output."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded checkpoint tensors into what `apply` runs on (repack, merge shard scales);
        nothing by default."""
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., input_size] -> [..., output_size] in x's dtype."""

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """silu(gate) * up of a gate_up layer's projection ([gate; up] rows, equal halves) in one fused
        kernel, or None where the method has none for this input (the caller then runs `apply` and
        the activation)."""
        return None


class UnquantizedLinearMethod(LinearMethodBase):
    """A dense weight [output, input] in the model's dtype: F.linear, or the GEMV / small-M kernels for
    decode batches where the fused ops are on (this is the bf16 path: nothing else runs)."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        weight = new_parameter(
            layer, "weight", (sum(output_sizes), input_size), params_dtype, output_dim=0, input_dim=1
        )
        weight.requires_grad_(True)  # as nn.Linear's; the loader freezes the whole model
        nn.init.kaiming_uniform_(weight, a=5**0.5)  # nn.Linear's init, for modules built in tests

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if use_fused_ops(x):
            from kvllm.layers.ops.gemv import gemv, use_gemv
            from kvllm.layers.ops.linear import is_narrow, linear, use_small_m_kernel

            if use_gemv(x, layer.weight, narrow=is_narrow(layer.weight)):
                return gemv(x, layer.weight, bias, constant_weight=True)
            if use_small_m_kernel(x, layer.weight):
                return linear(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The GEMV with the activation in its epilogue, for one row (or up to four of a narrow
        output) where fused ops are on."""
        if not use_fused_ops(x):
            return None
        from kvllm.layers.ops.gemv import gemv_silu_and_mul, use_gemv
        from kvllm.layers.ops.linear import is_narrow

        if use_gemv(x, layer.weight, narrow=is_narrow(layer.weight)):
            return gemv_silu_and_mul(x, layer.weight, bias, constant_weight=True)
        return None


class QuantizationConfig(ABC):
    """A quantization method's settings for one model (vLLM's QuantizationConfig)."""

    name: ClassVar[str]  # vLLM's name for the method (--quantization)

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """From a checkpoint's `quantization_config`; ValueError naming what kvllm lacks."""

    @abstractmethod
    def get_linear_method(self, prefixes: list[str]) -> LinearMethodBase:
        """The method for the linear layer whose checkpoint matrices are `prefixes` (one per fused
        shard, e.g. [model.layers.0.mlp.gate_proj, model.layers.0.mlp.up_proj]); the unquantized one
        for layers the checkpoint leaves unquantized."""

    def describe(self) -> str:
        """One line for the log: the method and its variant."""
        return self.name


def layer_is_ignored(prefixes: list[str], ignored: list[str] | tuple[str, ...] | None) -> bool:
    """Whether a (fused) layer is left unquantized: all of its shards in the checkpoint's list, or
    none; a ValueError when only some are (one fused matmul cannot mix formats)."""
    flags = [is_ignored(prefix, ignored) for prefix in prefixes]
    if any(flags) and not all(flags):
        kept = [p for p, flag in zip(prefixes, flags, strict=True) if not flag]
        raise ValueError(
            f"the checkpoint leaves only some of {prefixes} unquantized (quantized: {kept}); kvllm runs "
            "them as one fused matmul, which needs one format"
        )
    return bool(flags) and all(flags)


def is_ignored(prefix: str, ignored: list[str] | tuple[str, ...] | None) -> bool:
    """Whether a layer is in a checkpoint's not-quantized list: names matched as whole path
    components (`lm_head`, `down_proj`, `model.layers.0.mlp`), or `re:` regular expressions."""
    if not ignored:
        return False
    for entry in ignored:
        if entry.startswith("re:"):
            if re.match(entry[3:], prefix):
                return True
        elif (
            prefix == entry
            or prefix.endswith("." + entry)
            or prefix.startswith(entry + ".")
            or (f".{entry}." in f".{prefix}.")
        ):
            return True
    return False
