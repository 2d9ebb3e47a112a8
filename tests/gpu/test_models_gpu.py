"""On a CUDA GPU, in bfloat16: the engine's greedy ids and logprobs follow HF transformers in float32 for
every new model family, through every GPU backend that declares what the model's layers need; the others
must refuse it.

Run on the H200: `PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_models_gpu.py`.
The tiny random-weight models of tests/model_factory.py with heads of 128 (windows 24/48, Gemma 2 soft-caps 3 and 5, gpt-oss
sinks and YaRN, MoE layers running the Triton fused-MoE kernels), CUDA graphs on (the engine's default).
Judged by tests/gpu/bf16_judge.py: HF float32 on the same weights is the reference and HF's own bf16 run
the yardstick of bf16 rounding (logprob error within 3x HF bf16's, greedy flips only at near-ties both
runs' bf16 error reaches); every number goes to $KVLLM_GPU_REPORT_DIR/models_bf16_<model>_<backend>.json.
"""

from __future__ import annotations

import gc
import json
import os
import random
from pathlib import Path

import pytest
import torch

from kvllm import LLM, SamplingParams
from tests import model_factory
from tests.gpu.bf16_judge import TOP_LOGPROBS, failure_summary, judge_against_hf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_NEW_TOKENS = 16
PROMPT_LENGTHS = (1, 7, 33, 100, 300)
MODELS = ["qwen3_moe", "mixtral", "phi3", "gemma2", "gemma3", "gpt_oss"]
BACKENDS = ["TRITON_ATTN", "FLASH_ATTN", "FLEX_ATTENTION", "FLASHINFER"]
# FLEX_ATTENTION compiles per layer configuration (tens of seconds each): Gemma 2 (window + soft-cap) runs
# it, gpt-oss must be refused (sinks); the other families run the remaining backends.
CASES = [(m, b) for m in MODELS for b in BACKENDS if b != "FLEX_ATTENTION" or m in ("gemma2", "gpt_oss")]
HEAD_DIM = 128  # a head size every GPU backend takes (FLASHINFER: 128 only), so refusals are for features
KV_CACHE_BYTES = 64 * 2**20  # a small cache: fast start-up, and nothing here needs more
# What a refusal must name, per feature the tiny models use.
FEATURE_REASONS = ("sliding window not supported", "soft-cap", "attention sinks not supported")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = str(
                getattr(model_factory, f"make_tiny_{name}")(
                    Path(tmp_path_factory.mktemp(name)), head_dim=HEAD_DIM
                )
            )
        return cache[name]

    return get


def _selection_reasons(path: str, backend: str) -> list[str] | None:
    """None if `backend` can serve the model here, else its reasons (from the same selector config)."""
    from kvllm.attention.registry import get_backend_class, is_registered
    from kvllm.models.hf_config import load_hf_config, selector_config_from_hf_config
    from kvllm.platforms import current_device_info

    if not is_registered(backend):
        return [f"{backend} is not registered in this build"]
    device = current_device_info()
    config = selector_config_from_hf_config(load_hf_config(path), device, dtype="bfloat16")
    return get_backend_class(backend).validate_configuration(config, device) or None


@pytest.fixture(autouse=True)
def free_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize(("name", "backend"), CASES, ids=[f"{m}-{b}" for m, b in CASES])
def test_greedy_bf16_matches_hf_fp32(tiny_models, name, backend):
    path = tiny_models(name)
    reasons = _selection_reasons(path, backend)
    if reasons is not None:
        missing_package = all("not installed" in r or "not registered" in r for r in reasons)
        if not missing_package:
            # A refusal must be for a feature the model's layers use, never a silent wrong run.
            assert any(f in r for r in reasons for f in FEATURE_REASONS), reasons
            with pytest.raises(ValueError, match="not valid"):
                LLM(path, dtype="bfloat16", attention_backend=backend, kv_cache_memory_bytes=KV_CACHE_BYTES)
        pytest.skip(f"{backend} cannot serve {name}: {'; '.join(reasons)}")
    rng = random.Random(len(name))
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in PROMPT_LENGTHS]
    llm = LLM(
        path,
        dtype="bfloat16",
        attention_backend=backend,
        max_num_batched_tokens=128,
        max_num_seqs=16,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )
    assert llm.llm_engine.attention_backend_name == backend
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    judgements = [
        judge_against_hf(path, p, o.outputs[0].token_ids, o.outputs[0].logprobs, "cuda")
        for p, o in zip(prompts, outs)
    ]
    if out_dir := os.environ.get("KVLLM_GPU_REPORT_DIR"):
        with open(os.path.join(out_dir, f"models_bf16_{name}_{backend}.json"), "w") as f:
            from tests.hf_reference import _hf_model

            hf_attention = _hf_model(path, torch.float32, "cuda").config._attn_implementation
            report = {
                "model": name,
                "backend": backend,
                "hf_attn_implementation": hf_attention,
                "prompts": [j.to_dict() for j in judgements],
            }
            json.dump(report, f, indent=1)
    assert all(j.ok for j in judgements), failure_summary(judgements)
