"""EAGLE, EAGLE-3 and DeepSeek MTP heads through the engine: greedy ids equal to those without
speculation (tiny random heads in their published formats, tests/spec_heads.py), through chunked
prefill and preemption, with drafts both accepted and rejected; the heads' loading errors."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from kvllm import LLM, SamplingParams
from tests import model_factory, spec_heads

# Bytes of one 16-token block of the tiny Qwen3 (2 layers, K and V, 2 KV heads of 32, float32).
BLOCK_BYTES = 16 * 2 * 2 * 2 * 32 * 4
SMALL_CACHE = {"kv_cache_memory_bytes": 256 * BLOCK_BYTES}
MODES = {
    "default": SMALL_CACHE,
    "chunked_prefill": {**SMALL_CACHE, "max_num_batched_tokens": 32},
    # 14 target blocks (the head's one layer takes half as much again): prompts fit, outputs do not.
    "preemption": {"kv_cache_memory_bytes": 21 * BLOCK_BYTES, "block_size": 16, "max_model_len": 224},
}


def repetitive_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(n)] * 3 for n in lengths]


def _generate(path, prompts, params, **kwargs):
    llm = LLM(str(path), dtype="float32", seed=0, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def heads(tiny_qwen3_path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    return {
        "eagle": spec_heads.write_eagle_head(root / "eagle", tiny_qwen3_path),
        "eagle_own_embed": spec_heads.write_eagle_head(
            root / "eagle_own", tiny_qwen3_path, seed=1, with_embed=True, fc_bias=True, as_bin=True
        ),
        # The tiny target has 2 layers: the head reads the inputs of layers 0, 1 and 1 again.
        "eagle3": spec_heads.write_eagle3_head(root / "eagle3", tiny_qwen3_path, [0, 1, 1], draft_vocab=256),
    }


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V3 (MLA, MoE) with one MTP layer; tied embeddings and damped layers make it
    often repeat its last token, which the near-identity MTP layer drafts."""
    root = tmp_path_factory.mktemp("mtp")
    base = spec_heads.damp_layers(
        model_factory.make_tiny_deepseek_v3(root / "v3", tie_word_embeddings=True), 0.3
    )
    return spec_heads.add_mtp_layer(root / "v3_mtp", base)


CASES = [
    ("eagle", "default"),
    ("eagle_own_embed", "chunked_prefill"),
    ("eagle", "preemption"),
    ("eagle3", "default"),
]
_REFERENCE: dict[str, list] = {}


def _workload(mode: str) -> tuple[list[list[int]], list[SamplingParams]]:
    if mode == "preemption":  # 3 x 4 blocks of prompt fit the 14, their outputs do not
        prompts, max_tokens = repetitive_prompts([20, 20, 20], seed=3), [30, 28, 26]
    else:
        prompts, max_tokens = repetitive_prompts([2, 19, 40, 60], seed=3), [20, 24, 3, 16]
    return prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]


def _check_stats(llm: LLM) -> None:
    stats = llm.llm_engine.spec_decode.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts both kept and rejected
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    metrics = {m.name: m for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    assert metrics["vllm:spec_decode_num_drafts"].value == stats.num_drafts
    assert metrics["vllm:spec_decode_num_accepted_tokens"].value == stats.num_accepted_tokens
    assert metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values == stats.num_accepted_tokens_per_pos


@pytest.mark.parametrize(("head", "mode"), CASES)
def test_greedy_ids_equal_those_without_speculation(tiny_qwen3_path, heads, head, mode):
    prompts, params = _workload(mode)
    if mode not in _REFERENCE:
        _REFERENCE[mode] = _generate(tiny_qwen3_path, prompts, params, **MODES[mode])[0]
    method = "eagle3" if head == "eagle3" else "eagle"
    config = {"method": method, "model": str(heads[head]), "num_speculative_tokens": 3}
    ours, llm = _generate(tiny_qwen3_path, prompts, params, speculative_config=config, **MODES[mode])
    assert ours == _REFERENCE[mode]
    _check_stats(llm)
    if mode == "preemption":
        assert llm.llm_engine.stats().num_preemptions > 0


def test_eagle3_drafts_are_target_ids_through_d2t(tiny_qwen3_path, heads, monkeypatch):
    """The head's draft vocabulary is every other target token: its drafts, mapped by d2t, are
    even target ids, beyond the draft vocabulary's size too."""
    from kvllm.spec_decode.eagle import EagleProposer

    drafted: list[int] = []
    real = EagleProposer.propose
    monkeypatch.setattr(
        EagleProposer, "propose", lambda self, *a: [d for d in real(self, *a) if drafted.extend(d) or True]
    )
    prompts, params = _workload("default")
    config = {"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 2}
    _generate(tiny_qwen3_path, prompts[:2], params[:2], speculative_config=config, **SMALL_CACHE)
    assert drafted and all(t % 2 == 0 for t in drafted) and max(drafted) >= 256


def test_deepseek_mtp_greedy_ids_equal_those_without_speculation(mtp_target):
    prompts, params = _workload("default")
    reference, _ = _generate(mtp_target, prompts, params, **SMALL_CACHE)
    config = {"method": "deepseek_mtp", "num_speculative_tokens": 2}  # vLLM's older name for mtp
    ours, llm = _generate(mtp_target, prompts, params, speculative_config=config, **SMALL_CACHE)
    assert ours == reference
    assert llm.llm_engine.executor.worker.model_runner.kv_cache_spec.use_mla
    _check_stats(llm)


def test_heads_are_checked_when_loaded(tiny_qwen3_path, tiny_deepseek_v3_path, heads, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(heads["eagle"], broken)
    from safetensors.torch import load_file, save_file

    tensors = load_file(broken / "model.safetensors")
    del tensors["layers.0.mlp.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"EAGLE head: missing weights for layers\.0\.mlp\.down_proj\.weight"
    ):
        LLM(
            str(tiny_qwen3_path),
            speculative_config={"method": "eagle", "model": str(broken), "num_speculative_tokens": 2},
            **SMALL_CACHE,
        )
    # transformers' V3 config says one MTP layer; the random checkpoint it saved has none.
    with pytest.raises(ValueError, match=r"the checkpoint lacks weights of its 1 MTP layer\(s\)"):
        LLM(
            str(tiny_deepseek_v3_path),
            speculative_config={"method": "mtp", "num_speculative_tokens": 2},
            **SMALL_CACHE,
        )
    with pytest.raises(ValueError, match="runs DeepSeek-V3's MTP layers; the target is Qwen3ForCausalLM"):
        LLM(
            str(tiny_qwen3_path),
            speculative_config={"method": "mtp", "num_speculative_tokens": 2},
            **SMALL_CACHE,
        )
    bad_layers = spec_heads.write_eagle3_head(tmp_path / "e3", tiny_qwen3_path, [0, 1, 5])
    with pytest.raises(
        ValueError, match=r"auxiliary hidden-state layers \[0, 1, 5\] do not fit a target of 2"
    ):
        LLM(
            str(tiny_qwen3_path),
            speculative_config={"method": "eagle3", "model": str(bad_layers), "num_speculative_tokens": 2},
            **SMALL_CACHE,
        )
    assert torch.get_default_dtype() == torch.float32


class _TransformersHead:
    """A plain reference of the EAGLE / EAGLE-3 heads from transformers' Llama modules: the head over
    a whole sequence at once (no cache), the chain by running it again on each longer sequence."""

    def __init__(self, folder: Path, target, method: str) -> None:
        import json

        from safetensors.torch import load_file
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import (
            LlamaAttention,
            LlamaDecoderLayer,
            LlamaMLP,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        values = json.loads((folder / "config.json").read_text())
        self.config = config = LlamaConfig(**values, attn_implementation="eager")
        self.method, self.target = method, target
        w = {
            k.replace("midlayer.", "layers.0."): v for k, v in load_file(folder / "model.safetensors").items()
        }
        hidden = config.hidden_size
        self.fc = torch.nn.Linear(w["fc.weight"].shape[1], hidden, bias="fc.bias" in w)
        self.fc.load_state_dict({k[3:]: v for k, v in w.items() if k.startswith("fc.")})
        layer = {k[len("layers.0.") :]: v for k, v in w.items() if k.startswith("layers.0.")}
        self.rotary = LlamaRotaryEmbedding(config)
        if method == "eagle":
            self.layer = LlamaDecoderLayer(config, 0)
            self.layer.input_layernorm = torch.nn.Identity()
            self.layer.load_state_dict(layer)
            self.lm_head = target.lm_head.weight
            self.d2t = None
        else:
            self.attn = LlamaAttention(config, 0)
            for name in "qkv":
                proj = getattr(self.attn, f"{name}_proj")
                setattr(self.attn, f"{name}_proj", torch.nn.Linear(2 * hidden, proj.out_features, bias=False))
            self.attn.load_state_dict(
                {k[len("self_attn.") :]: v for k, v in layer.items() if "self_attn." in k}
            )
            self.mlp = LlamaMLP(config)
            self.mlp.load_state_dict({k[len("mlp.") :]: v for k, v in layer.items() if k.startswith("mlp.")})
            self.norms = {
                name: LlamaRMSNorm(hidden, config.rms_norm_eps)
                for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm")
            }
            for name, norm in self.norms.items():
                norm.weight.data.copy_(w[f"{name}.weight"] if name == "norm" else layer[f"{name}.weight"])
            self.lm_head, self.d2t = w["lm_head.weight"], w["d2t"]
            self.aux = values["eagle_config"]["eagle_aux_hidden_state_layer_ids"]

    def _layer(self, x: torch.Tensor, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[1]
        positions = torch.arange(n).unsqueeze(0)
        rope = self.rotary(x, positions)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        if self.method == "eagle":
            out = self.layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
            return out, out
        n_ = self.norms
        attn_in = torch.cat([n_["input_layernorm"](embeds), n_["hidden_norm"](x)], -1)
        h = x + self.attn(attn_in, position_embeddings=rope, attention_mask=mask)[0]
        h = h + self.mlp(n_["post_attention_layernorm"](h))
        return n_["norm"](h), h

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k drafts after `tokens` (the last one just emitted)."""
        ids = torch.tensor([tokens])
        out = self.target(ids, output_hidden_states=True)
        embed = self.target.model.embed_tokens
        if self.method == "eagle":
            hidden = self.target.model(ids).last_hidden_state
            x = self.fc(torch.cat([embed(ids[:, 1:]), hidden[:, :-1]], -1))
        else:
            aux = torch.cat([out.hidden_states[i] for i in self.aux], -1)
            x = self.fc(aux[:, :-1])
        embeds = embed(ids[:, 1:])
        drafts: list[int] = []
        for _ in range(k):
            logit_h, next_h = self._layer(x, embeds)
            draft = int((logit_h[0, -1] @ self.lm_head.T).argmax())
            if self.d2t is not None:
                draft += int(self.d2t[draft])
            drafts.append(draft)
            new = torch.tensor([[draft]])
            embeds = torch.cat([embeds, embed(new)], 1)
            if self.method == "eagle":
                x = torch.cat([x, self.fc(torch.cat([embed(new), next_h[:, -1:]], -1))], 1)
            else:  # EAGLE-3's later steps read the head's own (pre-norm) state, not fc's
                x = torch.cat([x, next_h[:, -1:]], 1)
        return drafts


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_every_draft_is_the_transformers_reference_heads(tiny_qwen3_path, heads, method, monkeypatch):
    """Each step's drafts equal those of a plain transformers re-implementation of the head run over
    the whole sequence without a cache: the head's paged KV cache (including the positions of
    rejected drafts, overwritten later) and its shifted inputs are exactly the full computation's."""
    from transformers import AutoModelForCausalLM

    from kvllm.spec_decode.eagle import EagleProposer

    calls: list[tuple[int, list[int]]] = []
    real = EagleProposer.propose

    def spy(self, logit_hidden, next_hidden, positions, *rest):
        drafts = real(self, logit_hidden, next_hidden, positions, *rest)
        calls.append((int(positions[0]), drafts[0]))
        return drafts

    monkeypatch.setattr(EagleProposer, "propose", spy)
    prompt = repetitive_prompts([2, 19], seed=3)[1]  # its output has runs the heads draft
    config = {"method": method, "model": str(heads[method]), "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (output,), llm = _generate(tiny_qwen3_path, [prompt], [params], speculative_config=config, **SMALL_CACHE)
    assert llm.llm_engine.spec_decode.stats.num_accepted_tokens > 0 and len(calls) > 2
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_path, dtype=torch.float32).eval()
    reference = _TransformersHead(heads[method], target, method)
    tokens = prompt + output
    for position, drafts in calls:  # the head's row sits at `position`; the token after it was emitted
        assert drafts == reference.drafts(tokens[: position + 2], 3)[: len(drafts)], position


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_beside_piecewise_graphs(tiny_qwen3_path, heads, method, monkeypatch):
    """With graphs (replayed eagerly on the CPU) the target's prefill and verification steps run as
    piecewise graphs and the EAGLE head reads their hidden states; EAGLE-3 reads auxiliary states
    the pieces do not return, so it runs the target eagerly. Greedy ids equal those without."""
    from kvllm.worker import model_runner

    monkeypatch.setattr(model_runner, "graphs_available", lambda device: True)
    prompts, params = _workload("default")
    kwargs = dict(SMALL_CACHE, max_num_batched_tokens=64)  # CPU_ATTN runs between the pieces
    reference, _ = _generate(tiny_qwen3_path, prompts, params, **kwargs)
    config = {"method": method, "model": str(heads[method]), "num_speculative_tokens": 3}
    ours, llm = _generate(tiny_qwen3_path, prompts, params, speculative_config=config, **kwargs)
    assert ours == reference
    runner = llm.llm_engine.executor.worker.model_runner
    if method == "eagle":
        assert runner.piecewise is not None and runner.piecewise.num_replays > 0
    else:
        assert runner.piecewise is None
    assert llm.llm_engine.spec_decode.stats.num_accepted_tokens > 0
