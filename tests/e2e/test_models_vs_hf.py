"""Every model family beyond Llama/Qwen, as tiny random-weight HF folders: the engine's greedy ids and
logprobs equal HF transformers' on the CPU, through each backend that runs here and serves the model.

The tiny models are built so each feature moves the output: prompts run past the sliding windows (24
and 48 tokens), the Gemma 2 soft-caps are small enough to bend the logits (3 on attention, 5 on the
final logits), gpt-oss has random sinks and YaRN RoPE, the MoE models route to many experts.
Chunked prefill (32-token steps) splits the prompts across the window boundary.

Backends: CPU_ATTN for every model. FLEX_ATTENTION (also a CPU backend; eager here, as compiling its
kernels costs tens of seconds per configuration on this CPU) for Gemma 2, whose window and soft-cap it
declares, and it must refuse gpt-oss (no sinks). TRITON_ATTN's kernels under the Triton interpreter
on a simulated SM 9.0 for Gemma 2 (soft-cap, window) and gpt-oss (sinks, window), on the prompts that
run past the window (the interpreter is slow).
Tolerance for logprobs: 1e-3 absolute; both sides run float32 and differ in reduction order (~1e-5).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvllm import LLM, SamplingParams
from tests import model_factory
from tests.hf_reference import hf_greedy

MAX_NEW_TOKENS = 8
PROMPT_LENGTHS = [1, 6, 30, 61, 100]
LOGPROB_ATOL = 1e-3
MODELS = ["qwen3_moe", "mixtral", "phi3", "gemma2", "gemma3", "gpt_oss"]
TRITON_MODELS = ["gemma2", "gpt_oss"]
TRITON_PROMPTS = 2  # the longest


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """name -> (folder, prompts, HF's greedy tokens and logprobs per prompt), built once per module."""
    built: dict[str, tuple[str, list[list[int]], list]] = {}

    def get(name: str):
        if name not in built:
            path = str(getattr(model_factory, f"make_tiny_{name}")(Path(tmp_path_factory.mktemp(name))))
            rng = random.Random(len(name))
            prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in PROMPT_LENGTHS]
            built[name] = path, prompts, [hf_greedy(path, p, MAX_NEW_TOKENS)[:2] for p in prompts]
        return built[name]

    return get


def check_against_hf(llm: LLM, prompts, reference, label: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output, (ref_tokens, ref_logprobs) in zip(prompts, outputs, reference):
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens, f"{label}: prompt of {len(prompt)} tokens diverged"
        ours = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        assert ours == pytest.approx(ref_logprobs, abs=LOGPROB_ATOL), label
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, f"{label}: KV blocks leaked"


@pytest.mark.parametrize("name", MODELS)
def test_cpu_attn_matches_hf(tiny_model, name):
    path, prompts, reference = tiny_model(name)
    llm = LLM(path, dtype="float32", seed=0, attention_backend="CPU_ATTN", max_num_batched_tokens=32)
    assert llm.llm_engine.attention_backend_name == "CPU_ATTN"
    check_against_hf(llm, prompts, reference, f"{name}/CPU_ATTN")


def test_flex_attention_matches_hf_on_gemma2(tiny_model, monkeypatch):
    path, prompts, reference = tiny_model("gemma2")
    monkeypatch.setenv("KVLLM_FLEX_COMPILE", "0")
    llm = LLM(path, dtype="float32", seed=0, attention_backend="FLEX_ATTENTION", max_num_batched_tokens=32)
    assert llm.llm_engine.attention_backend_name == "FLEX_ATTENTION"
    check_against_hf(llm, prompts, reference, "gemma2/FLEX_ATTENTION")


def test_flex_attention_refuses_gpt_oss_sinks(tiny_model):
    path, _, _ = tiny_model("gpt_oss")
    with pytest.raises(ValueError, match="attention sinks not supported"):
        LLM(path, dtype="float32", attention_backend="FLEX_ATTENTION")


@pytest.mark.parametrize("name", TRITON_MODELS)
def test_triton_attn_interpreted_matches_hf(tiny_model, name):
    from kvllm.platforms import simulate_platform

    path, prompts, reference = tiny_model(name)
    with simulate_platform("cuda", (9, 0)):
        llm = LLM(path, dtype="float32", seed=0, attention_backend="TRITON_ATTN", max_num_batched_tokens=32)
    assert llm.llm_engine.attention_backend_name == "TRITON_ATTN"
    check_against_hf(llm, prompts[-TRITON_PROMPTS:], reference[-TRITON_PROMPTS:], f"{name}/TRITON_ATTN")
