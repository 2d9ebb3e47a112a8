"""The decoder layers' linear maps: `Linear`, and layers that fuse several checkpoint matrices into one,
each shard loaded by name.

A layer's parameters and its forward come from its LinearMethod (kvllm/layers/quantization/base.py):
unquantized, the weight is nn.Linear's [output, input] matrix and the forward runs, where fused ops
are on, the GEMV kernel (kvllm/layers/ops/gemv.py) for one row (and for up to four rows of a narrow
output), the small-M tensor-core kernel (kvllm/layers/ops/linear.py) for other decode-sized inputs
of a narrow output, and F.linear otherwise;
a quantized checkpoint's method registers its own tensors (packed int4 weights, fp8 weights and
scales) and kernels. The LM head is not one of these: `compute_logits` calls F.linear on the head's
weight directly.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which copies one
checkpoint tensor into it (into one shard's rows for fused layers), so the model's `load_weights` is a
name mapping and nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvllm.layers.quantization.base import LinearMethodBase, UnquantizedLinearMethod

if TYPE_CHECKING:
    from kvllm.layers.quantization.base import QuantizationConfig


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter of the same shape (casting dtype and device)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded_weight.shape)}"
        )
    param.data.copy_(loaded_weight)


class Linear(nn.Module):
    """y = x W^T + b through the layer's LinearMethod; unquantized it has nn.Linear's parameters and
    state dict (`weight` [output, input], `bias`).

    `output_sizes` (default: one shard of `output_size`) lists the rows of each shard stacked along the
    output; a shard is addressed by its index or by a name from `shard_names`. `prefix` is the layer's
    name in the model and `shard_prefixes` its shards' names in the checkpoint, which a quantization
    config matches against its not-quantized list.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        output_sizes: list[int] | None = None,
        shard_names: tuple[str, ...] | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        shard_prefixes: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.output_sizes = list(output_sizes) if output_sizes is not None else [output_size]
        if sum(self.output_sizes) != output_size:
            raise ValueError(f"output_sizes {self.output_sizes} do not add up to output_size {output_size}")
        self.in_features, self.out_features = input_size, output_size  # nn.Linear's names
        self.shard_names = shard_names or tuple(str(i) for i in range(len(self.output_sizes)))
        self.prefix = prefix
        self.quant_method: LinearMethodBase = (
            quant_config.get_linear_method(shard_prefixes or [prefix])
            if quant_config is not None
            else UnquantizedLinearMethod()
        )
        params_dtype = torch.get_default_dtype()
        self.quant_method.create_weights(self, input_size, self.output_sizes, params_dtype)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype))
            self.bias.output_dim = 0  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def _shard_index(self, shard_id: int | str | None) -> int | None:
        if shard_id is None:
            return None
        if isinstance(shard_id, str):
            if shard_id not in self.shard_names:
                raise ValueError(f"unknown shard {shard_id!r}; this layer has {self.shard_names}")
            return self.shard_names.index(shard_id)
        return shard_id

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        """Copy one checkpoint tensor into `param`: all of it (shard_id None), or one shard's part."""
        index = self._shard_index(shard_id)
        if getattr(param, "per_shard", False):  # one entry per shard: per-tensor scales, shapes
            entry = param.data[index or 0]
            if loaded_weight.numel() != entry.numel():
                raise ValueError(
                    f"{self.prefix}: expected {entry.numel()} value(s) per shard, got {tuple(loaded_weight.shape)}"
                )
            entry.copy_(loaded_weight.reshape(entry.shape))
            return
        dim = getattr(param, "output_dim", None)
        if index is None or dim is None:
            if index is not None and getattr(param, "loaded", False):  # a tensor the shards share
                if not torch.equal(param.data, loaded_weight.to(param.device, param.dtype)):
                    raise ValueError(
                        f"{self.prefix}: shard {shard_id!r} has a different {tuple(loaded_weight.shape)} tensor "
                        "than another shard, where the fused layer needs one shared tensor"
                    )
                return
            default_weight_loader(param, loaded_weight)
            param.loaded = True  # type: ignore[attr-defined]
            return
        start, size = sum(self.output_sizes[:index]), self.output_sizes[index]
        divisor = getattr(param, "output_divisor", 1)
        if start % divisor:
            raise ValueError(
                f"{self.prefix}: shard {shard_id!r} starts at output row {start}, which is not a multiple "
                f"of the {divisor} rows one element of this tensor covers"
            )
        length = -(-size // divisor)
        default_weight_loader(param.data.narrow(dim, start // divisor, length), loaded_weight)


class MergedLinear(Linear):
    """Several linear maps of one input stacked along the output dimension (e.g. gate_proj + up_proj)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        shard_names: tuple[str, ...] | None = None,
        *,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        shard_prefixes: list[str] | None = None,
    ) -> None:
        super().__init__(
            input_size,
            sum(output_sizes),
            bias,
            output_sizes=output_sizes,
            shard_names=shard_names,
            quant_config=quant_config,
            prefix=prefix,
            shard_prefixes=shard_prefixes,
        )

    def gated(self, x: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """act(self(x)) for a gate_up pair ([gate; up], equal halves). SiLU runs as one kernel with the
        activation in its epilogue where the layer's method has one for this input (the bf16 and
        W4A16 GEMVs: decode rows, fused ops on); anything else runs the projection, then `act`."""
        from kvllm.layers.activation import SiluAndMul

        if (
            type(act) is SiluAndMul
            and len(self.output_sizes) == 2
            and self.output_sizes[0] == self.output_sizes[1]
        ):
            fused = self.quant_method.apply_silu_and_mul(self, x, self.bias)
            if fused is not None:
                return fused
        return act(self(x))


class QKVLinear(MergedLinear):
    """The q, k and v projections of attention as one matmul; shards are "q", "k" and "v"."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        *,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        shard_prefixes: list[str] | None = None,
    ) -> None:
        self.q_size = num_heads * head_size
        self.kv_size = num_kv_heads * head_size
        super().__init__(
            hidden_size,
            [self.q_size, self.kv_size, self.kv_size],
            bias,
            ("q", "k", "v"),
            quant_config=quant_config,
            prefix=prefix,
            shard_prefixes=shard_prefixes,
        )

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v
