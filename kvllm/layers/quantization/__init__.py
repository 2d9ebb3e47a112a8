"""Quantized checkpoints: which method a model uses, from `--quantization` and the checkpoint's
`quantization_config` (config.json), resolved as vLLM resolves them.

kvllm has AWQ (4-bit GEMM format), GPTQ (4-bit, act-order, sym/asym), fp8 (W8A8 per-tensor,
per-channel and 128x128 block-wise; online from a 16-bit checkpoint) and compressed-tensors (fp8 W8A8,
W4A16 pack-quantized). The method names live in kvllm/config/quantization.py (EngineArgs checks them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvllm.config.quantization import (  # noqa: F401  (re-exported: the names live with the config)
    QUANTIZATION_ALIASES,
    QUANTIZATION_METHODS,
    VLLM_ONLY_METHODS,
    canonical_method,
)
from kvllm.logger import init_logger

if TYPE_CHECKING:
    from torch import nn

    from kvllm.layers.quantization.base import QuantizationConfig

logger = init_logger(__name__)


def checkpoint_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The `quantization_config` of config.json (or of its text config) as a dict, or None."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        text = getattr(hf_config, "text_config", None)
        config = getattr(text, "quantization_config", None) if text is not None else None
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    return dict(config)


def get_quantization_config(requested: str | None, hf_config: Any) -> QuantizationConfig | None:
    """The model's QuantizationConfig, or None for an unquantized model.

    The checkpoint's `quantization_config` decides; `requested` (--quantization) must name the same
    method, or be fp8 on an unquantized checkpoint (online quantization, as vLLM).
    """
    checkpoint = checkpoint_quantization_config(hf_config)
    method = canonical_method(requested) if requested is not None else None
    if checkpoint is None:
        if method is None:
            return None
        if method != "fp8":
            raise ValueError(
                f"quantization={requested!r} needs a checkpoint quantized with {method} (config.json has no "
                "quantization_config); only fp8 quantizes a 16-bit checkpoint online. Use a quantized "
                "model folder, or --quantization fp8."
            )
        from kvllm.layers.quantization.fp8 import Fp8Config

        config: QuantizationConfig = Fp8Config.for_online_quantization()
    else:
        raw = str(checkpoint.get("quant_method", "")).strip().lower()
        if not raw:
            raise ValueError(f"the checkpoint's quantization_config has no quant_method: {checkpoint}")
        ckpt_method = canonical_method(raw)
        if method is not None and method != ckpt_method:
            raise ValueError(
                f"quantization={requested!r} does not match the checkpoint, which is quantized with {raw!r} "
                "(config.json quantization_config); leave --quantization unset or pass that method"
            )
        config = _config_class(ckpt_method).from_config(checkpoint)
    logger.info("quantization: %s", config.describe())
    return config


def _config_class(method: str) -> type[QuantizationConfig]:
    if method == "awq":
        from kvllm.layers.quantization.awq import AWQConfig

        return AWQConfig
    if method == "gptq":
        from kvllm.layers.quantization.gptq import GPTQConfig

        return GPTQConfig
    if method == "fp8":
        from kvllm.layers.quantization.fp8 import Fp8Config

        return Fp8Config
    from kvllm.layers.quantization.compressed_tensors import CompressedTensorsConfig

    return CompressedTensorsConfig


def process_weights_after_loading(model: nn.Module) -> None:
    """Every linear layer's post-load step (repacking, merged shard scales); nothing for unquantized."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
