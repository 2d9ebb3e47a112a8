"""fp8 checkpoints (`quant_method: fp8`) and online fp8 (`--quantization fp8` on a 16-bit checkpoint).

Checkpoint tensors per layer: `weight` fp8 e4m3 [N, K] with either `weight_scale` (one float32 per
matrix, so one per shard of a fused layer) or, with `weight_block_size` [bn, bk] (DeepSeek-V3,
Qwen3-FP8), `weight_scale_inv` [ceil(N / bn), ceil(K / bk)] (a multiplier despite its name, as in
vLLM); `input_scale` (one per matrix) when `activation_scheme` is static. W = weight * scale.

On CUDA the activations are quantized too (W8A8): per token (dynamic) or with the static input scale,
and torch._scaled_mm multiplies with a scale per output channel (per-tensor scales of a fused layer's
shards become per-channel ones); block-scaled weights take activations quantized per (token, 128
columns) and the Triton block GEMM. Elsewhere (CPU) the same arithmetic runs by dequantization: the
activations are quantized and dequantized the same way, the weight dequantized, then F.linear. Online quantization: a scale per output
channel, activations per token (vLLM uses per-tensor weight scales here; per-channel loses less).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    UnquantizedLinearMethod,
    layer_is_ignored,
    new_parameter,
    replace_parameter,
)
from kvllm.layers.quantization.ops.fp8 import (
    FP8,
    FP8_MAX,
    MIN_SCALE,
    block_fp8_linear,
    dequantize_block,
    quantize_fp8,
    scaled_mm_rowwise,
)
from kvllm.logger import init_logger

logger = init_logger(__name__)
DUMMY_WEIGHT_STD = 1.0  # fp8 values about N(0, 1); with DUMMY_SCALE the weights are N(0, 0.02)
DUMMY_SCALE = 0.02


def _dummy_fp8(param: torch.Tensor, generator: torch.Generator) -> None:
    values = torch.randn(param.shape, generator=generator, device=param.device) * DUMMY_WEIGHT_STD
    param.copy_(values.to(param.dtype))


def _dummy_scale(param: torch.Tensor, generator: torch.Generator) -> None:
    param.fill_(DUMMY_SCALE)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """16-bit weight [N, K] -> (fp8 [N, K], float32 scales [N]), each row's largest magnitude at 448."""
    scale = (weight.float().abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (weight.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Config(QuantizationConfig):
    """fp8 W8A8: per-tensor or block-wise weight scales, dynamic or static activation scales."""

    name = "fp8"

    def __init__(
        self,
        online: bool = False,
        static_activations: bool = False,
        weight_block_size: tuple[int, int] | None = None,
        ignored_layers: list[str] | None = None,
    ) -> None:
        self.online = online
        self.static_activations = static_activations
        self.weight_block_size = weight_block_size
        self.ignored_layers = list(ignored_layers or [])

    @classmethod
    def for_online_quantization(cls) -> Fp8Config:
        """`--quantization fp8` on a 16-bit checkpoint."""
        return cls(online=True)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        scheme = str(config.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise ValueError(
                f"fp8 activation_scheme {scheme!r} is not available; kvllm has 'dynamic' and 'static'"
            )
        fmt = str(config.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"fp8 format {fmt!r} is not available; kvllm has e4m3")
        block = config.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or int(block[1]) != 128 or int(block[0]) % 16:
                raise ValueError(
                    f"fp8 weight_block_size {block} is not available; kvllm has [n, 128] blocks, n a multiple of 16"
                )
            if scheme == "static":
                raise ValueError(
                    "fp8 block-wise weights with static activation scales are not available in kvllm"
                )
            block = (int(block[0]), int(block[1]))
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert")
        return cls(False, scheme == "static", block, ignored)

    def get_linear_method(self, prefixes: list[str]) -> LinearMethodBase:
        if layer_is_ignored(prefixes, self.ignored_layers):
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(self)

    def describe(self) -> str:
        if self.online:
            return "fp8 (online: per-channel weight scales from the 16-bit checkpoint, dynamic per-token activations)"
        weights = f"block {list(self.weight_block_size)}" if self.weight_block_size else "per-tensor"
        activations = "static" if self.static_activations else "dynamic"
        return f"fp8 ({weights} weight scales, {activations} activation scales)"


class Fp8LinearMethod(LinearMethodBase):
    """fp8 weights run by torch._scaled_mm or the block GEMM on CUDA, dequantized elsewhere."""

    def __init__(self, config: Fp8Config) -> None:
        self.config = config

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        n, shards = sum(output_sizes), len(output_sizes)
        if self.config.online:
            new_parameter(layer, "weight", (n, input_size), params_dtype, 0, input_dim=1)
            return
        new_parameter(layer, "weight", (n, input_size), FP8, 0, dummy_init=_dummy_fp8, input_dim=1)
        block = self.config.weight_block_size
        if block is not None:
            shape = (-(-n // block[0]), -(-input_size // block[1]))
            new_parameter(
                layer,
                "weight_scale_inv",
                shape,
                torch.float32,
                0,
                block[0],
                dummy_init=_dummy_scale,
                input_dim=1,
                input_divisor=block[1],
            )
        else:
            new_parameter(
                layer,
                "weight_scale",
                (shards,),
                torch.float32,
                None,
                per_shard=True,
                dummy_init=_dummy_scale,
                input_dim=None,
            )
        if self.config.static_activations:
            new_parameter(
                layer,
                "input_scale",
                (shards,),
                torch.float32,
                None,
                per_shard=True,
                dummy_init=_dummy_scale,
                input_dim=None,
            )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.config.online:
            weight, scale = quantize_per_channel(layer.weight.data)
            replace_parameter(layer, "weight", weight)
            layer.register_parameter("weight_scale", nn.Parameter(scale, requires_grad=False))
        elif self.config.weight_block_size is None:
            sizes = torch.tensor(layer.output_sizes, device=layer.weight_scale.device)
            replace_parameter(layer, "weight_scale", layer.weight_scale.data.repeat_interleave(sizes))
            if self.config.static_activations:
                # The shards see the same input: one scale, the largest, covers them all (as vLLM).
                replace_parameter(layer, "input_scale", layer.input_scale.data.max().reshape(1))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        block = self.config.weight_block_size
        if x.is_cuda:
            if block is not None:
                out = block_fp8_linear(x2.contiguous(), layer.weight, layer.weight_scale_inv, block, bias)
            else:
                input_scale = layer.input_scale if self.config.static_activations else None
                out = scaled_mm_rowwise(x2.contiguous(), layer.weight, layer.weight_scale, bias, input_scale)
        else:  # the same W8A8 arithmetic, by dequantization
            if block is not None:
                weight = dequantize_block(layer.weight, layer.weight_scale_inv, block)
                xq, x_scale = quantize_fp8(x2, block[1])
                x_scale = x_scale.repeat_interleave(block[1], dim=1)
            else:
                weight = layer.weight.float() * layer.weight_scale[:, None]
                if self.config.static_activations:
                    x_scale = layer.input_scale.float()
                    xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
                else:
                    xq, x_scale = quantize_fp8(x2)
            out = F.linear((xq.float() * x_scale).to(x.dtype), weight.to(x.dtype), bias)
        return out.reshape(*shape[:-1], -1)
