"""Tiny random draft heads in their published formats, built beside a tiny target for tests:
EAGLE-1 and EAGLE-3 heads (SafeAILab/EAGLE's config.json + safetensors names) and DeepSeek-V3 MTP
layers appended to a V3 checkpoint (as `model.layers.{num_hidden_layers}.*`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def _small(generator: torch.Generator, *shape: int, scale: float = 0.02) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=generator)


def _llama_layer(
    prefix: str, config: dict, generator: torch.Generator, qkv_in: int
) -> dict[str, torch.Tensor]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return {
        f"{prefix}self_attn.q_proj.weight": _small(generator, heads * head_dim, qkv_in, scale=0.2),
        f"{prefix}self_attn.k_proj.weight": _small(generator, kv_heads * head_dim, qkv_in, scale=0.2),
        f"{prefix}self_attn.v_proj.weight": _small(generator, kv_heads * head_dim, qkv_in),
        f"{prefix}self_attn.o_proj.weight": _small(generator, hidden, heads * head_dim),
        f"{prefix}mlp.gate_proj.weight": _small(generator, inter, hidden),
        f"{prefix}mlp.up_proj.weight": _small(generator, inter, hidden),
        f"{prefix}mlp.down_proj.weight": _small(generator, hidden, inter),
        f"{prefix}post_attention_layernorm.weight": torch.ones(hidden),
    }


def _target(target: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return json.loads((target / "config.json").read_text()), load_file(target / "model.safetensors")


def _head_config(config: dict, **extra) -> dict:
    keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
    )
    out = {k: config[k] for k in keys if k in config}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        **out,
        **extra,
    }


def write_eagle_head(
    path: Path,
    target: Path,
    seed: int = 0,
    with_embed: bool = False,
    fc_bias: bool = False,
    as_bin: bool = False,
) -> Path:
    """An EAGLE-1 head for `target` (a Llama-family folder): fc reads mostly the hidden-state half
    (near [0 | I]) and the layer adds small random terms, so its draft is often the target's own
    last prediction again, and sometimes right."""
    from safetensors.torch import save_file

    config, weights = _target(target)
    hidden = config["hidden_size"]
    generator = torch.Generator().manual_seed(seed)
    fc = torch.cat(
        [_small(generator, hidden, hidden), torch.eye(hidden) + _small(generator, hidden, hidden)], 1
    )
    tensors = {"fc.weight": fc, **_llama_layer("layers.0.", config, generator, hidden)}
    if fc_bias:
        tensors["fc.bias"] = _small(generator, hidden)
    if with_embed:
        tensors["embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    path.mkdir(parents=True, exist_ok=True)
    if as_bin:  # as yuhuili/EAGLE-LLaMA3-Instruct-8B was published
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(_head_config(config)))
    return path


def write_eagle3_head(
    path: Path, target: Path, aux_layers: list[int], seed: int = 0, draft_vocab: int = 0
) -> Path:
    """An EAGLE-3 head for `target`: fc reads the last auxiliary state (near [0 | 0 | I]); its LM head is
    the target's embedding rows of a draft vocabulary (every other token when `draft_vocab` is set,
    mapped back by `d2t` / `t2d`)."""
    from safetensors.torch import save_file

    config, weights = _target(target)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    fc = torch.cat(
        [_small(generator, hidden, 2 * hidden), torch.eye(hidden) + _small(generator, hidden, hidden)], 1
    )
    tensors = {"fc.weight": fc, **_llama_layer("midlayer.", config, generator, 2 * hidden)}
    tensors["midlayer.input_layernorm.weight"] = torch.ones(hidden)
    tensors["midlayer.hidden_norm.weight"] = torch.ones(hidden)
    tensors["norm.weight"] = torch.ones(hidden)
    embed = weights["model.embed_tokens.weight"]
    lm = weights.get("lm_head.weight", embed)
    extra = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layers}}
    if draft_vocab:
        kept = torch.arange(0, vocab, vocab // draft_vocab)[:draft_vocab]
        tensors["lm_head.weight"] = lm[kept].clone()
        tensors["d2t"] = kept - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[kept] = True
        tensors["t2d"] = t2d
        extra["draft_vocab_size"] = draft_vocab
    else:
        tensors["lm_head.weight"] = lm.clone()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(_head_config(config, **extra)))
    return path


def damp_layers(folder: Path, factor: float) -> Path:
    """Scale a model folder's attention and MLP output projections (o_proj, down_proj) in place: with
    tied embeddings, the smaller the factor the more the model repeats its last token, which the
    near-identity heads above draft."""
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * factor
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def add_mtp_layer(path: Path, target: Path, seed: int = 0) -> Path:
    """A copy of a DeepSeek-V3 folder with one MTP layer (`num_nextn_predict_layers` = 1): the last main
    layer's tensors again as layer L's decoder block (damped to near the identity), random
    enorm/hnorm/eh_proj near [0 | I], the target's embedding and LM head as its own. `damping` scales
    the main layers' output projections (o_proj, down_proj) too: below 1 the target repeats itself more."""
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, path / f.name)
    config = json.loads((target / "config.json").read_text())
    weights = load_file(target / "model.safetensors")
    num_layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    generator = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    for name in list(weights):
        if name.startswith(last):
            tensor = weights[name].clone()
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensor *= 0.05  # a block near the identity: the layer's draft is often the last prediction
            weights[mtp + name[len(last) :]] = tensor
    weights[mtp + "enorm.weight"] = 1 + _small(generator, hidden, scale=0.1)
    weights[mtp + "hnorm.weight"] = 1 + _small(generator, hidden, scale=0.1)
    eh = torch.cat(
        [_small(generator, hidden, hidden), torch.eye(hidden) + _small(generator, hidden, hidden)], 1
    )
    weights[mtp + "eh_proj.weight"] = eh
    weights[mtp + "shared_head.norm.weight"] = torch.ones(hidden)
    weights[mtp + "shared_head.head.weight"] = weights.get(
        "lm_head.weight", weights["model.embed_tokens.weight"]
    ).clone()
    weights[mtp + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return path
