"""Count the kernels one decoder layer launches in a forward step: torch path against the fused kernels.

    python tools/count_layer_launches.py [--device cuda] [--tokens 4]

Qwen3-0.6B's layer (hidden 1024, 16 q / 8 kv heads of 128, QK-norm, intermediate 3072) and a Llama-style
one (no QK-norm), random weights. The attention call itself is replaced by a pass-through, since what it
launches depends on the backend. Two counts per path:
- dispatch: torch ops that launch a kernel, seen by a TorchDispatchMode (views and allocations excluded;
  each fused kernel wrapper counts as one launch, the ops inside it are not counted);
- cuda (with --device cuda): kernels the torch profiler saw on the GPU.
"""

from __future__ import annotations

import argparse
import importlib
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

WRAPPERS = [
    ("kvllm.layers.ops.rms_norm", "rms_norm"),
    ("kvllm.layers.ops.rms_norm", "fused_add_rms_norm"),
    ("kvllm.layers.ops.activation", "silu_and_mul"),
    ("kvllm.layers.ops.rotary", "qk_norm_rope"),
]


class LaunchCounter(TorchDispatchMode):
    """Counts ops with a kernel behind them; paused inside fused kernel wrappers (counted as one each)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and not name.startswith("empty") and name != "lift_fresh":
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _spy_wrappers(counter: LaunchCounter) -> list[tuple[Any, str, Any]]:
    patched = []
    for module_name, name in WRAPPERS:
        module = importlib.import_module(module_name)
        real = getattr(module, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            counter.ops[f"triton:{_name}"] += 1
            counter.paused += 1
            try:
                return _real(*args, **kwargs)
            finally:
                counter.paused -= 1

        setattr(module, name, spy)
        patched.append((module, name, real))
    return patched


def build_layer(qk_norm: bool, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import Qwen3Config

    from kvllm.layers.rotary import RotaryEmbedding, rope_parameters_from_config
    from kvllm.models.llama import LlamaDecoderLayer

    config = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=128, num_hidden_layers=1, max_position_embeddings=4096)  # fmt: skip
    with torch.device(device):
        rotary = RotaryEmbedding(config.head_dim, 4096, rope_parameters_from_config(config))
        layer = LlamaDecoderLayer(config, 0, rotary, qkv_bias=False, qk_norm=qk_norm).to(dtype)
    layer.self_attn.attn.forward = lambda q, k, v: q  # pass-through: attention is the backend's business
    return layer, rotary


def count(qk_norm: bool, mode: str, device: torch.device, num_tokens: int) -> tuple[Counter[str], int | None]:
    from kvllm.layers.ops.dispatch import fused_ops_mode, use_fused_ops

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer, rotary = build_layer(qk_norm, device, dtype)
    hidden = torch.randn(num_tokens, 1024, device=device, dtype=dtype)
    residual = torch.randn_like(hidden)
    positions = torch.arange(num_tokens, device=device)
    with fused_ops_mode(mode), torch.no_grad():
        rope = rotary.prepare(positions, dtype, fused=use_fused_ops(hidden))
        layer(rope, hidden, residual)  # warm-up (Triton compiles)
        counter = LaunchCounter()
        patched = _spy_wrappers(counter)
        try:
            with counter:
                layer(rope, hidden, residual)
        finally:
            for module, name, real in patched:
                setattr(module, name, real)
        cuda_kernels = None
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                layer(rope, hidden, residual)
                torch.cuda.synchronize()
            cuda_kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return counter.ops, cuda_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=4)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"one decoder layer (not counting attention itself), {args.tokens} tokens, device {device}")
    for qk_norm in (True, False):
        for mode in ("0", "1"):
            ops, cuda_kernels = count(qk_norm, mode, device, args.tokens)
            label = f"{'Qwen3 (QK-norm)' if qk_norm else 'Llama'}, {'fused' if mode == '1' else 'torch'}"
            cuda = f", cuda kernels {cuda_kernels}" if cuda_kernels is not None else ""
            print(f"{label:24} dispatch launches {sum(ops.values()):3}{cuda}: {dict(sorted(ops.items()))}")


if __name__ == "__main__":
    main()
