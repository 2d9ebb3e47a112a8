"""Tensor parallel on the CPU: TP=2 over gloo (two worker processes) gives TP=1's greedy ids, and the
workers never outlive their engine (shut down, or their driver gone); the Ray executor likewise."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from kvllm import LLM, SamplingParams
from kvllm.sampling_params import StructuredOutputsParams
from tests import model_factory

PROMPTS = [[1, 5, 9, 33, 17], [4, 8, 15, 16, 23, 42, 7, 99, 3], [250, 11], [7, 7, 30]]
REGEX = r"[a-e]{3,8}"
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=1 << 22, max_num_seqs=4)


def _generate(llm: LLM) -> list[tuple[str, list[int]]]:
    # Two greedy requests, a seeded sampled one (every rank samples alike; rank 0 answers) and one
    # constrained by a grammar (the driver fills the masks of the rows the ranks sample).
    params = [
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=7),
        SamplingParams(max_tokens=10, temperature=0, structured_outputs=StructuredOutputsParams(regex=REGEX)),
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    got = [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]
    assert re.fullmatch(REGEX, got[-1][0]), got[-1]
    return got


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        if not alive:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "deepseek_v3", "phi3"])
def test_tp2_over_gloo_matches_tp1_and_its_workers_exit(family: str, tmp_path: Path) -> None:
    if family == "llama":  # 4 query / 2 KV heads: each rank holds 2 and 1, untied LM head
        path = model_factory.make_tiny_llama(tmp_path / family)
    elif family == "phi3":  # fused qkv_proj / gate_up_proj checkpoint tensors, cut per rank at load
        path = model_factory.make_tiny_phi3(tmp_path / family)
    elif family == "qwen3":  # 4 query heads / 1 KV head (replicated on both ranks), QK-norm, tied embeddings
        path = model_factory.make_tiny_qwen3(tmp_path / family, num_key_value_heads=1, vocab_size=511)
    elif family == "gemma3":  # scaled embedding, GeGLU, QK-norm, sliding window, soft-capped logits
        path = model_factory.make_tiny_gemma3(tmp_path / family, sliding_window=8)
    else:  # MLA heads split, latent cache whole; experts (FusedMoE, as Qwen3-MoE's) and a shared one split
        path = model_factory.make_tiny_deepseek_v3(tmp_path / family)
    tp1 = LLM(str(path), **ENGINE)
    expected = _generate(tp1)
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    # A rank caches its own KV heads: half of Llama's two, Qwen3's one replicated, MLA's whole latent.
    share = {"llama": 2, "qwen3": 1, "gemma3": 2, "deepseek_v3": 1, "phi3": 2}[family]
    assert llm.llm_engine.executor.bytes_per_block() * share == tp1.llm_engine.executor.bytes_per_block()
    pids = llm.llm_engine.executor.worker_pids
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    assert _generate(llm) == expected
    if family == "llama":
        # As if the driver died (SIGKILL: no shutdown, no atexit): the kernel closes its pipe ends.
        for conn in llm.llm_engine.executor._conns:
            conn.close()
    else:
        llm.llm_engine.shutdown()
    assert _wait_gone(pids) == []


def test_tp2_with_the_grammar_process_matches_tp1(tiny_llama_path: Path) -> None:
    """The grammar process answers the driver with a pending mask, which the driver waits for before it
    sends the masks to the ranks (they sample in their own processes)."""
    expected = _generate(LLM(str(tiny_llama_path), **ENGINE))
    llm = LLM(str(tiny_llama_path), tensor_parallel_size=2, grammar_process=True, **ENGINE)
    assert _generate(llm) == expected
    assert llm.llm_engine.structured_output_manager.grammar_process.num_steps > 0
    llm.llm_engine.shutdown()


@pytest.fixture
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()


def test_ray_executor_on_a_local_head_matches_tp1(local_ray, tiny_llama_path: Path) -> None:
    expected = _generate(LLM(str(tiny_llama_path), **ENGINE))
    llm = LLM(str(tiny_llama_path), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    pids = llm.llm_engine.executor.worker_pids
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert _generate(llm) == expected
    llm.llm_engine.shutdown()
    assert _wait_gone(pids) == []


def test_a_family_not_split_yet_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    path = model_factory.make_tiny_gpt_oss(tmp_path / "gpt_oss")
    with pytest.raises(ValueError, match=r"GptOssForCausalLM does not run with tensor parallel"):
        LLM(str(path), tensor_parallel_size=2, **ENGINE)
