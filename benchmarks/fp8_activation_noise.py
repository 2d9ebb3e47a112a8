"""How far W8A8 (fp8) logits move on the CPU path when the activations are bf16 instead of float32.

    PYTHONPATH=. python benchmarks/fp8_activation_noise.py

The model of `tests/gpu/test_quant_gpu.py::test_quantized_model_on_gpu_matches_cpu_path` (a tiny Qwen3,
hidden 256, 2 heads / 1 KV head of 128) in fp8 block, per-tensor and online form, and unquantized,
each run on the CPU path in float32 and in bfloat16 on the same prompt. Prints the largest logit
difference against the logit range: the noise that dynamic activation quantization adds (bf16 and
float32 activations round to different fp8 values near a boundary), which that GPU test allows.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvllm.config.engine import EngineArgs  # noqa: E402
from kvllm.forward_context import set_forward_context  # noqa: E402
from kvllm.models.loader import load_model  # noqa: E402
from kvllm.models.model_config import ModelConfig  # noqa: E402
from tests.model_factory import make_tiny_qwen3  # noqa: E402
from tests.quant_checkpoints import fp8_checkpoint  # noqa: E402

PROMPT = torch.tensor([5, 17, 33, 2, 9, 100, 7, 250, 3] * 3)  # the GPU test's prompt


def logits(folder: Path, dtype: str, quantization: str | None) -> torch.Tensor:
    args = EngineArgs(model=str(folder), dtype=dtype, quantization=quantization)
    model = load_model(ModelConfig.from_engine_args(args, torch.device("cpu")), "auto", torch.device("cpu"))
    with torch.no_grad(), set_forward_context(None):
        return model.compute_logits(model(PROMPT, torch.arange(len(PROMPT)))).float()


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    base = make_tiny_qwen3(tmp / "base", hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=128, intermediate_size=512)  # fmt: skip
    for fmt in ("block", "tensor", "online", "none"):
        quantization = "fp8" if fmt == "online" else None
        folder = fp8_checkpoint(base, tmp / fmt, fmt) if fmt in ("block", "tensor") else base
        ref = logits(folder, "float32", quantization)
        err = (logits(folder, "bfloat16", quantization) - ref).abs().max().item()
        span = ref.abs().max().item()
        label = "unquantized" if fmt == "none" else f"fp8-{fmt}"
        print(
            f"{label:<12} bf16 vs float32 on the CPU path: max |diff| {err:.3f}, range {span:.2f}, {err / span:.1%}"
        )


if __name__ == "__main__":
    main()
