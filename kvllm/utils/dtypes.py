"""Name <-> torch dtype conversions for model and KV-cache dtypes (the names: kvllm.config.choices)."""

from __future__ import annotations

import torch

_MODEL_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# kv_cache_dtype name -> storage dtype of an fp8 cache.
FP8_TORCH_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def torch_dtype(name: str) -> torch.dtype:
    return _MODEL_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _MODEL_DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported model dtype {dtype}")


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the KV cache for the user's kv_cache_dtype setting."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in FP8_TORCH_DTYPES:
        return FP8_TORCH_DTYPES[kv_cache_dtype]
    return _MODEL_DTYPES[kv_cache_dtype]


def cache_torch_dtype_is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES
