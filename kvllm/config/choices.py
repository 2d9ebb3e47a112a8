"""The vocabulary of user choices: every value a setting may take, written once (no torch).

EngineArgs validates against these tuples, the CLI help lists them, and the floors above (dtype
rules, loaders, backends) read them from here instead of keeping copies.
"""

from __future__ import annotations

# Model dtypes a user may ask for; "half" and "float" are aliases (DTYPE_ALIASES).
DTYPES = ("auto", "float16", "half", "bfloat16", "float32", "float")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# The dtypes a model runs in, once "auto" and aliases are resolved.
MODEL_DTYPES = ("float16", "bfloat16", "float32")
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEVICES = ("auto", "cpu", "cuda")
GENERATION_CONFIGS = ("auto", "vllm")


def canonical_dtype(name: str) -> str:
    """A dtype name without aliases ("half" -> "float16"); other names pass through."""
    return DTYPE_ALIASES.get(name, name)


# Tokenizer modes kvllm loads (vLLM's --tokenizer-mode): both mean the Hugging Face tokenizer.
TOKENIZER_MODES = ("auto", "hf")
SCHEDULING_POLICIES = ("fcfs", "priority")
# generation_config.json key -> SamplingParams field, for the keys vLLM takes as sampling defaults
# (also the keys --override-generation-config may set).
GENERATION_CONFIG_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
GENERATION_CONFIG_SAMPLING_KEYS = tuple(GENERATION_CONFIG_SAMPLING)
# The keys of vLLM's --compilation-config that mean something to kvllm (it compiles nothing).
COMPILATION_CONFIG_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size", "cudagraph_mode")
# cudagraph_mode values kvllm runs: no graphs; full graphs of decode steps only; or those plus
# piecewise graphs (the model between attention calls) for every other step, vLLM's default.
CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
OPTIMIZATION_LEVELS = (0, 1, 2, 3)
