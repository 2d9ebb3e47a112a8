"""Building a model with its weights from a resolved ModelConfig."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvllm.config.choices import LOAD_FORMATS

if TYPE_CHECKING:
    from kvllm.models.model_config import ModelConfig


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model_config: ModelConfig, load_format: str, device: torch.device) -> nn.Module:
    """The model of `model_config` on `device` in its dtype, in eval mode, with weights loaded.

    load_format: "auto"/"safetensors" read the folder's safetensors; "gguf" the same, from the folder a
    GGUF file was converted to (an error for other folders); "dummy" draws random weights (seeded by
    torch's global generator).
    """
    from kvllm.models.loader.dummy import init_dummy_weights
    from kvllm.models.loader.gguf import is_converted_gguf_folder
    from kvllm.models.loader.weights import iterate_safetensors
    from kvllm.models.registry import get_model_class

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not valid; allowed: {', '.join(LOAD_FORMATS)}")
    if load_format == "gguf" and not is_converted_gguf_folder(model_config.model_path):
        raise ValueError(f"load_format='gguf' needs a .gguf model file; {model_config.model!r} is not one")
    from kvllm.layers.quantization import process_weights_after_loading

    model_cls = get_model_class([model_config.architecture])
    quant_config = getattr(model_config, "quant_config", None)
    kwargs = {}
    if quant_config is not None:
        if not getattr(model_cls, "supports_quantization", False):
            raise ValueError(
                f"{model_config.architecture} has no quantized layers in kvllm ({quant_config.name}); "
                "use an unquantized checkpoint of it"
            )
        kwargs["quant_config"] = quant_config
    with _default_dtype(model_config.dtype), torch.device(device):
        model = model_cls(model_config.hf_config, **kwargs)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        loaded = model.load_weights(iterate_safetensors(model_config.model_path))
        missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
        if missing:
            raise ValueError(
                f"checkpoint {model_config.model_path!r} lacks weights for {len(missing)} parameters, "
                f"e.g. {', '.join(missing[:5])}"
            )
    process_weights_after_loading(model)
    return model.eval().requires_grad_(False)
