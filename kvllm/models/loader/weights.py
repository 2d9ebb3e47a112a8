"""Reading checkpoint tensors from an HF model folder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch


def safetensors_files(folder: str | Path) -> list[Path]:
    """The folder's safetensors files, from its index when it has one; ValueError when there are none."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors weights in {str(folder)!r}; kvllm loads safetensors folders and GGUF files "
            "(use load_format='dummy' for random weights)"
        )
    return files


def iterate_safetensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the folder's safetensors files, read lazily on CPU."""
    from safetensors import safe_open

    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
