"""Tensor parallel on the CPU: TP=2 over gloo (two worker processes) gives TP=1's greedy ids, and the
workers never outlive their engine (shut down, or killed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvllm import LLM, SamplingParams
from tests import model_factory

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 5, 9, 33, 17], [4, 8, 15, 16, 23, 42, 7, 99, 3], [250, 11]]
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=1 << 22, max_num_seqs=4)


def _generate(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _params() -> list[SamplingParams]:
    # Two greedy requests and one seeded sampled one: every rank samples alike, rank 0 answers.
    return [
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=7),
    ]


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


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tp2_over_gloo_matches_tp1_and_its_workers_exit(family: str, tmp_path: Path) -> None:
    if family == "llama":  # 4 query / 2 KV heads: each rank holds 2 and 1, untied LM head
        path = model_factory.make_tiny_llama(tmp_path / family)
    else:  # 4 query heads / 1 KV head (replicated on both ranks), QK-norm, tied embeddings, vocab 512
        path = model_factory.make_tiny_qwen3(tmp_path / family, num_key_value_heads=1, vocab_size=511)
    expected = _generate(LLM(str(path), **ENGINE), _params())
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    executor = llm.llm_engine.executor
    pids = executor.worker_pids
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    assert _generate(llm, _params()) == expected
    llm.llm_engine.shutdown()
    assert _wait_gone(pids) == []


DRIVER = """
import os, signal, sys
from kvllm import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", kv_cache_memory_bytes=1 << 22)
print(*llm.llm_engine.executor.worker_pids, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no shutdown, no atexit: the workers see their pipes close
"""


def test_workers_exit_when_the_driver_is_killed(tiny_llama_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tiny_llama_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    pids = [int(pid) for pid in proc.stdout.split()]
    assert len(pids) == 2
    assert _wait_gone(pids) == []


def test_a_family_not_split_yet_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    path = model_factory.make_tiny_gemma2(tmp_path / "gemma2")
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM does not run with tensor parallel"):
        LLM(str(path), tensor_parallel_size=2, **ENGINE)
