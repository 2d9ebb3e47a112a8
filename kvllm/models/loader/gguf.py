"""Converting a Llama-architecture GGUF file, once, into a normal HF model folder.

The folder (config.json, model.safetensors with dequantized float32 weights, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json) is cached under
$KVLLM_CACHE_DIR, else $XDG_CACHE_HOME/kvllm, else ~/.cache/kvllm, in gguf/<stem>-<key>/. It is
written to a temporary folder and renamed into place, so concurrent processes never see half of one.
HF transformers loads the same folder, which makes it the reference for tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Bump when the output of the conversion changes, so stale cached folders are not reused.
CONVERTER_VERSION = 1
MARKER_FILE = "kvllm_gguf_source.json"

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Pre-tokenizer regex of Llama 3 ("llama-bpe"); digits in runs of up to three.
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def cache_root() -> Path:
    if os.environ.get("KVLLM_CACHE_DIR"):
        return Path(os.environ["KVLLM_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvllm"


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def is_converted_gguf_folder(folder: str | os.PathLike[str]) -> bool:
    return (Path(folder) / MARKER_FILE).is_file()


def converted_gguf_folder(gguf_path: str | os.PathLike[str]) -> str:
    """The cached HF folder of a GGUF file, converting it first if needed. Safe to call concurrently."""
    gguf_path = Path(gguf_path).resolve()
    stat = gguf_path.stat()
    key_source = f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}|v{CONVERTER_VERSION}"
    key = hashlib.sha256(key_source.encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    if is_converted_gguf_folder(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not is_converted_gguf_folder(target):  # not another process winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write the HF folder of a Llama-architecture GGUF file into `out_dir`."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {str(gguf_path)!r} has architecture {arch!r}; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    config = _hf_config(fields, has_output=any(t.name == "output.weight" for t in reader.tensors))
    config.save_pretrained(out_dir)
    _write_weights(reader, config, out_dir)
    _write_tokenizer(fields, out_dir, config.max_position_embeddings)
    generation_config = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    if config.pad_token_id is not None:
        generation_config["pad_token_id"] = config.pad_token_id
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    marker = {
        "source": str(gguf_path),
        "converter_version": CONVERTER_VERSION,
        "name": fields.get("general.name"),
    }
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2))


def _hf_config(fields: dict[str, Any], has_output: bool) -> Any:
    from transformers import LlamaConfig

    def arch_field(name: str, default: Any = None) -> Any:
        return fields.get(f"llama.{name}", default)

    num_heads = int(arch_field("attention.head_count"))
    hidden_size = int(arch_field("embedding_length"))
    head_dim = int(arch_field("attention.key_length", hidden_size // num_heads))
    rope_parameters: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(arch_field("rope.freq_base", 10000.0)),
    }
    if arch_field("rope.scaling.type") == "linear":
        rope_parameters.update(rope_type="linear", factor=float(arch_field("rope.scaling.factor")))
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=len(fields["tokenizer.ggml.tokens"]),
        hidden_size=hidden_size,
        intermediate_size=int(arch_field("feed_forward_length")),
        num_hidden_layers=int(arch_field("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(arch_field("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(arch_field("context_length")),
        rms_norm_eps=float(arch_field("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters=rope_parameters,
        tie_word_embeddings=not has_output,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
        # Weights are stored in float32 (the exact dequantized values); GPUs run them in bfloat16.
        dtype="bfloat16",
    )


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K rows for its interleaved RoPE (back to HF's rotate-half)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _hf_tensor_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")


def _write_weights(reader: Any, config: Any, out_dir: Path) -> None:
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            raise ValueError(
                "GGUF files with per-frequency RoPE factors (rope_freqs, e.g. Llama 3.1) are not supported; "
                "pass the model's HF folder instead"
            )
        weight = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)  # owned, writable
        if tensor.name.endswith("attn_q.weight"):
            weight = _unpermute_rows(weight, config.num_attention_heads)
        elif tensor.name.endswith("attn_k.weight"):
            weight = _unpermute_rows(weight, config.num_key_value_heads)
        tensors[_hf_tensor_name(tensor.name)] = torch.from_numpy(np.ascontiguousarray(weight))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _pre_tokenizer(pre: str | None) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in (None, "default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre == "llama-bpe":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(
        f"GGUF tokenizer pre-tokenizer {pre!r} is not supported; supported: smollm, gpt2, llama-bpe"
    )


def _write_tokenizer(fields: dict[str, Any], out_dir: Path, max_length: int) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model_type = fields.get("tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {model_type!r} is not supported; supported: gpt2 (byte-level BPE)"
        )
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    token_types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in fields["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens(
        [
            AddedToken(token, special=kind == _TOKEN_TYPE_CONTROL, normalized=False)
            for token, kind in zip(tokens, token_types)
            if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
        ]
    )

    def token(field: str) -> str | None:
        token_id = fields.get(f"tokenizer.ggml.{field}_token_id")
        return tokens[token_id] if token_id is not None else None

    bos = token("bos")
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
                ),
            ]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "chat_template": fields.get("tokenizer.chat_template"),
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
