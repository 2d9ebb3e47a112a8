"""The decoder layers' linear maps: `Linear`, and layers that fuse several checkpoint matrices into one,
each shard loaded by name.

`Linear` is nn.Linear whose forward runs, where fused ops are on, the GEMV kernel
(kvllm/layers/ops/gemv.py) for one row (and for up to four rows of a narrow output), the small-M
tensor-core kernel (kvllm/layers/ops/linear.py) for other decode-sized inputs of a narrow output, and
F.linear otherwise. The LM head is not one of these:
`compute_logits` calls F.linear on the head's weight directly.

A fused layer's parameters carry a `weight_loader(param, loaded_weight, shard_id)` that copies one
checkpoint tensor into its rows, so the model's `load_weights` is a name mapping and nothing else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.layers.ops.dispatch import use_fused_ops


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter of the same shape (casting dtype and device)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded_weight.shape)}"
        )
    param.data.copy_(loaded_weight)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) that runs a few rows through the decode kernels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_ops(x):
            from kvllm.layers.ops.gemv import gemv, use_gemv
            from kvllm.layers.ops.linear import is_narrow, linear, use_small_m_kernel

            if use_gemv(x, self.weight, narrow=is_narrow(self.weight)):
                return gemv(x, self.weight, self.bias)
            if use_small_m_kernel(x, self.weight):
                return linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linear maps of one input stacked along the output dimension (e.g. gate_proj + up_proj).

    `output_sizes` lists the rows of each shard; a shard is addressed by its index or by a name from
    `shard_names`.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        shard_names: tuple[str, ...] | None = None,
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)
        self.shard_names = shard_names or tuple(str(i) for i in range(len(output_sizes)))
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def gated(self, x: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """act(self(x)) for a gate_up pair ([gate; up], equal halves). SiLU on one row (or up to four
        of a narrow output) where fused ops are on is one GEMV launch with the activation in its
        epilogue; anything else runs the projection, then `act`."""
        from kvllm.layers.activation import SiluAndMul

        if (
            type(act) is SiluAndMul
            and use_fused_ops(x)
            and len(self.output_sizes) == 2
            and self.output_sizes[0] == self.output_sizes[1]
        ):
            from kvllm.layers.ops.gemv import gemv_silu_and_mul, use_gemv
            from kvllm.layers.ops.linear import is_narrow

            if use_gemv(x, self.weight, narrow=is_narrow(self.weight)):
                return gemv_silu_and_mul(x, self.weight, self.bias)
        return act(self(x))

    def _shard_rows(self, shard_id: int | str) -> tuple[int, int]:
        index = self.shard_names.index(shard_id) if isinstance(shard_id, str) else shard_id
        start = sum(self.output_sizes[:index])
        return start, self.output_sizes[index]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str) -> None:
        start, size = self._shard_rows(shard_id)
        default_weight_loader(param.data.narrow(0, start, size), loaded_weight)


class QKVLinear(MergedLinear):
    """The q, k and v projections of attention as one matmul; shards are "q", "k" and "v"."""

    def __init__(
        self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        self.q_size = num_heads * head_size
        self.kv_size = num_kv_heads * head_size
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias, ("q", "k", "v"))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v
