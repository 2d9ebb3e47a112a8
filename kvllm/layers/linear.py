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

Tensor parallel (`parallel="column"` / `"row"`, vLLM's ColumnParallelLinear / RowParallelLinear): a
column-parallel layer holds each shard's 1/N of the output rows, a row-parallel one 1/N of the input
columns and sums the ranks' partial outputs (one all-reduce, the bias added after it). The loader cuts
each checkpoint tensor to this rank's part as it copies. At TP=1 (N = 1) nothing of this exists: the
layer is built and runs as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvllm.distributed.communication import tensor_model_parallel_all_reduce
from kvllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
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


def kv_heads_per_rank(num_kv_heads: int, tp_size: int | None = None) -> int:
    """KV heads each tensor-parallel rank holds: its share, or one replicated head when there are
    fewer KV heads than ranks (all of them at TP=1)."""
    tp = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
    return max(num_kv_heads // tp, 1)


class Linear(nn.Module):
    """y = x W^T + b through the layer's LinearMethod; unquantized it has nn.Linear's parameters and
    state dict (`weight` [output, input], `bias`).

    `output_sizes` (default: one shard of `output_size`) lists the rows of each shard stacked along the
    output; a shard is addressed by its index or by a name from `shard_names`. `prefix` is the layer's
    name in the model and `shard_prefixes` its shards' names in the checkpoint, which a quantization
    config matches against its not-quantized list. `parallel` ("column", "row" or None) splits the
    layer over the tensor-parallel ranks; `output_sizes` and `input_size` are the whole layer's.
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
        parallel: str | None = None,
    ) -> None:
        super().__init__()
        full_sizes = list(output_sizes) if output_sizes is not None else [output_size]
        if sum(full_sizes) != output_size:
            raise ValueError(f"output_sizes {full_sizes} do not add up to output_size {output_size}")
        if parallel not in (None, "column", "row"):
            raise ValueError(f"parallel={parallel!r} is not valid; allowed: None, 'column', 'row'")
        self.prefix = prefix
        self.tp_size = get_tensor_model_parallel_world_size() if parallel else 1
        self.tp_rank = get_tensor_model_parallel_rank() if parallel else 0
        self.parallel = parallel if self.tp_size > 1 else None
        self.reduce_results = self.parallel == "row"  # a bool: forward's one check at TP=1
        # Per shard: which 1/N slice of the checkpoint's rows this rank holds (column parallel).
        self.shard_slices = [self.tp_rank] * len(full_sizes)
        if self.parallel == "column":
            self.output_sizes = self._column_sizes(full_sizes)
        else:
            self.output_sizes = full_sizes
        if self.parallel == "row":
            if input_size % self.tp_size:
                raise ValueError(
                    f"{prefix}: input size {input_size} does not split over tensor_parallel_size={self.tp_size}"
                )
            input_size //= self.tp_size
        output_size = sum(self.output_sizes)
        self.in_features, self.out_features = input_size, output_size  # nn.Linear's names (this rank's)
        self.shard_names = shard_names or tuple(str(i) for i in range(len(self.output_sizes)))
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
            self.bias.input_dim = None  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        for name, param in self.named_parameters(recurse=False):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            if self.parallel == "row" and not hasattr(param, "input_dim"):
                raise ValueError(
                    f"{prefix}: {type(self.quant_method).__name__} does not say how its {name!r} splits "
                    f"along the input, so this layer cannot run with tensor_parallel_size={self.tp_size}; "
                    "use tensor_parallel_size=1 or an unquantized, fp8, AWQ or GPTQ checkpoint"
                )

    def _column_sizes(self, output_sizes: list[int]) -> list[int]:
        """This rank's rows of each shard (and `shard_slices`) for a column-parallel layer."""
        bad = [size for size in output_sizes if size % self.tp_size]
        if bad:
            raise ValueError(
                f"{self.prefix}: output sizes {output_sizes} do not split over "
                f"tensor_parallel_size={self.tp_size}"
            )
        return [size // self.tp_size for size in output_sizes]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce_results:
            return self.quant_method.apply(self, x, self.bias)
        out = tensor_model_parallel_all_reduce(self.quant_method.apply(self, x, None))
        return out if self.bias is None else out + self.bias

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
        """Copy one checkpoint tensor into `param`: all of it (shard_id None), or one shard's part;
        under tensor parallel, only this rank's part of it."""
        index = self._shard_index(shard_id)
        if self.parallel is not None:
            loaded_weight = self._tensor_parallel_part(param, loaded_weight, index)
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

    def _tensor_parallel_part(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, index: int | None
    ) -> torch.Tensor:
        """The part of a whole checkpoint tensor (one shard's, for fused layers) this rank holds."""
        if getattr(param, "per_shard", False):  # one scalar per matrix: every rank has it
            return loaded_weight
        if self.parallel == "row":
            dim = getattr(param, "input_dim", None)
            size, divisor, piece = self.in_features, getattr(param, "input_divisor", 1), self.tp_rank
        else:
            dim = getattr(param, "output_dim", None)
            if dim is not None and index is None and len(self.output_sizes) > 1:
                raise ValueError(
                    f"{self.prefix}: the checkpoint stores the shards {self.shard_names} as one tensor, which "
                    f"kvllm does not split for tensor_parallel_size={self.tp_size}; use tensor_parallel_size=1"
                )
            shard = index or 0
            size, divisor, piece = (
                self.output_sizes[shard],
                getattr(param, "output_divisor", 1),
                self.shard_slices[shard],
            )
        if dim is None:  # the same for every rank (input-independent biases and scales, shared tensors)
            return loaded_weight
        if size % divisor:
            raise ValueError(
                f"{self.prefix}: this rank's {size} {'inputs' if self.parallel == 'row' else 'outputs'} are not "
                f"a multiple of the {divisor} one element of {tuple(param.shape)} covers, so the layer cannot "
                f"split over tensor_parallel_size={self.tp_size}"
            )
        length = size // divisor
        return loaded_weight.narrow(dim, piece * length, length)


class MergedLinear(Linear):
    """Several linear maps of one input stacked along the output dimension (e.g. gate_proj + up_proj);
    column parallel by default (each rank holds its slice of every shard)."""

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
        parallel: str | None = "column",
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
            parallel=parallel,
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
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        super().__init__(
            hidden_size,
            [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size],
            bias,
            ("q", "k", "v"),
            quant_config=quant_config,
            prefix=prefix,
            shard_prefixes=shard_prefixes,
        )
        # This rank's heads (all of them at TP=1).
        self.q_size, self.kv_size = self.output_sizes[0], self.output_sizes[1]
        self.num_heads, self.num_kv_heads = self.q_size // head_size, self.kv_size // head_size

    def _column_sizes(self, output_sizes: list[int]) -> list[int]:
        """Query heads split over the ranks; KV heads too, or, when there are fewer KV heads than ranks,
        each KV head replicated on the ranks whose query heads read it."""
        tp, heads, kv_heads = self.tp_size, self.total_num_heads, self.total_num_kv_heads
        if heads % tp or (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
            raise ValueError(
                f"{self.prefix}: {heads} attention heads and {kv_heads} KV heads do not split over "
                f"tensor_parallel_size={tp} (it must divide the heads, and divide or be a multiple of the KV heads)"
            )
        local_kv = kv_heads_per_rank(kv_heads, tp)
        kv_slice = self.tp_rank if kv_heads >= tp else self.tp_rank // (tp // kv_heads)
        self.shard_slices = [self.tp_rank, kv_slice, kv_slice]
        return [heads // tp * self.head_size, local_kv * self.head_size, local_kv * self.head_size]

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v
