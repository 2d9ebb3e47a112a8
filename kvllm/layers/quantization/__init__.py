"""Quantized checkpoints: which method a model uses, from `--quantization` and the checkpoint's
`quantization_config` (config.json), resolved as vLLM resolves them.

kvllm has AWQ (4-bit GEMM format), GPTQ (4-bit, act-order, sym/asym), fp8 (W8A8 per-tensor,
per-channel and 128x128 block-wise; online from a 16-bit checkpoint) and compressed-tensors (fp8 W8A8,
W4A16 pack-quantized). Nothing here imports torch at module level: EngineArgs validates names with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvllm.logger import init_logger

if TYPE_CHECKING:
    from torch import nn

    from kvllm.layers.quantization.base import QuantizationConfig

logger = init_logger(__name__)

QUANTIZATION_METHODS = ("awq", "gptq", "fp8", "compressed-tensors")
# vLLM names for kernels of a method kvllm has (run by kvllm's own kernels for that method).
QUANTIZATION_ALIASES = {
    "awq_marlin": "awq",
    "gptq_marlin": "gptq",
    "compressed_tensors": "compressed-tensors",
    "fbgemm_fp8": "fp8",
}
# vLLM 0.22's other --quantization choices, named in the error.
VLLM_ONLY_METHODS = (
    "aqlm", "auto-round", "bitblas", "bitsandbytes", "deepspeedfp", "experts_int8", "fp_quant",
    "gguf", "gptq_bitblas", "gptq_marlin_24", "hqq", "inc", "ipex", "marlin", "modelopt",
    "modelopt_fp4", "moe_wna16", "mxfp4", "petit_nvfp4", "ptpc_fp8", "quark", "rtn", "torchao", "tpu_int8",
)  # fmt: skip


def canonical_method(name: str) -> str:
    """kvllm's name for a --quantization value (aliases mapped, with a log line); ValueError otherwise."""
    key = name.strip().lower()
    if key in QUANTIZATION_METHODS:
        return key
    if key in QUANTIZATION_ALIASES:
        method = QUANTIZATION_ALIASES[key]
        logger.info(
            "quantization %r: running it with kvllm's %s kernels (Triton / torch._scaled_mm)", name, method
        )
        return method
    known = " (a vLLM method kvllm does not have)" if key in VLLM_ONLY_METHODS else ""
    raise ValueError(
        f"quantization={name!r}{known} is not available in kvllm; it has: {', '.join(QUANTIZATION_METHODS)} "
        f"(also accepted: {', '.join(QUANTIZATION_ALIASES)}). Leave it unset to use the checkpoint's "
        "quantization_config, or use an unquantized model."
    )


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
