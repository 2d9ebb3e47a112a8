"""The model's tokenizer: finding its files and loading the fast (Rust `tokenizers`) version."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(folder: str) -> bool:
    """Whether a folder holds a tokenizer (transformers 5 otherwise builds an empty one silently)."""
    return any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(tokenizer_path: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer in `tokenizer_path` (ModelConfig.tokenizer_path)."""
    from transformers import AutoTokenizer

    if not has_tokenizer_files(tokenizer_path):
        raise ValueError(
            f"no tokenizer files (tokenizer.json, tokenizer.model or vocab.json) in {tokenizer_path!r}; "
            "pass a tokenizer folder with tokenizer=..."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {tokenizer_path!r}: {e}") from e
    if not tokenizer.is_fast:
        raise ValueError(f"the tokenizer in {tokenizer_path!r} has no fast (tokenizer.json) version")
    return tokenizer


def tokenizer_eos_id(tokenizer_path: str) -> int | None:
    """The EOS id of the tokenizer in `tokenizer_path`, or None when there is none to read."""
    from transformers import AutoTokenizer

    if not has_tokenizer_files(tokenizer_path):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError):
        return None
    return tokenizer.eos_token_id
