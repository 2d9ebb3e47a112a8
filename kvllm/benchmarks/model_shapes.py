"""Config-only model folders with the shapes of real models, for `--load-format dummy` benchmarks.

A folder holds the model's config.json and a minimal word-level tokenizer (the engine loads a
tokenizer for every model). Benchmarks send random token ids; ids beyond the tiny tokenizer's
vocabulary are valid model inputs and simply decode to no text.

    python -m kvllm.benchmarks.model_shapes Qwen3-0.6B /tmp/qwen3-0.6b-shape
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "initializer_range": 0.02,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}

LLAMA_3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "bos_token_id": 128000,
    "eos_token_id": 128009,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}

# Qwen3-8B: 32 query / 8 KV heads of 128, untied LM head (the tensor-parallel benchmark's model).
QWEN3_8B: dict[str, Any] = {
    **QWEN3_0_6B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "max_window_layers": 36,
    "tie_word_embeddings": False,
}

MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B": QWEN3_0_6B,
    "Qwen3-8B": QWEN3_8B,
    "Llama-3-8B": LLAMA_3_8B,
}

_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_WORDS = ("the", "a", "model", "token", "cache", "block", "attention", "batch", "benchmark", "random")


def write_minimal_tokenizer(path: Path) -> None:
    """A word-level tokenizer of a few words (ids 0-2 are <|endoftext|>, <|im_start|>, <|im_end|>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate((*_SPECIAL_TOKENS, *_WORDS))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=_SPECIAL_TOKENS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(_SPECIAL_TOKENS))
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "model_max_length": 1 << 20,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_shape_only_model(
    name: str, path: str | Path, quantization_config: dict[str, Any] | None = None
) -> Path:
    """Write the config-only folder of model `name` (one of MODEL_SHAPES) to `path`, with a
    checkpoint `quantization_config` when given (for quantized dummy-weight benchmarks)."""
    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; allowed: {', '.join(MODEL_SHAPES)}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(MODEL_SHAPES[name])
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_minimal_tokenizer(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write a config-only model folder for dummy-weight benchmarks."
    )
    parser.add_argument("name", choices=sorted(MODEL_SHAPES))
    parser.add_argument("path")
    args = parser.parse_args(argv)
    print(write_shape_only_model(args.name, args.path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
