"""The --quantization names kvllm has, and vLLM's other names for them (no torch: EngineArgs checks
values with these; kvllm/layers/quantization builds the methods)."""

from __future__ import annotations

from kvllm.logger import init_logger

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
