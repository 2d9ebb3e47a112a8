"""On a CUDA GPU: decode steps replayed from CUDA graphs, and the other steps replayed from piecewise
graphs (kvllm/worker/piecewise_graph.py), give the eager engine's greedy ids.

Eager and graph steps run the same kernels, but a graph's launch sizes are fixed at capture
(TRITON_ATTN splits the KV by max_model_len, FLASH_ATTN gets max_seqlen_k = max_model_len), so the
float reductions may run in another order. A greedy choice may then flip only where the eager run's
own top-2 logprob gap is a bf16 tie; every prompt must match token for token until such a step.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from kvllm import LLM, SamplingParams
from tests.gpu.test_engine_cuda import _backend_usable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Logprob nats = bf16 logit gap: at |logit| 8-16 one bf16 step is 0.0625, so gaps up to about two
# steps are ties of the rounded logits (graphs and eager both run bf16 here, so a fixed bound fits).
TIE_GAP = 0.15
GRAPH_BACKENDS = ["TRITON_ATTN", "FLASHINFER", "FLASH_ATTN"]


def _run(path: str, backend: str, enforce_eager: bool, prompts, max_tokens):
    llm = LLM(
        path,
        dtype="bfloat16",
        attention_backend=backend,
        gpu_memory_utilization=0.25,
        max_model_len=2048,
        max_num_seqs=32,
        enforce_eager=enforce_eager,
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runner = llm.llm_engine.executor.worker.model_runner.graph_runner
    piecewise = llm.llm_engine.executor.worker.model_runner.piecewise
    replays = (
        runner.num_replays if runner is not None else 0,
        piecewise.num_replays if piecewise is not None else 0,
    )
    result = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    del llm
    torch.cuda.empty_cache()
    return result, replays


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_graph_decode_matches_eager(qwen3_small, backend, monkeypatch):
    """Also for a backend whose graph hooks are not declared yet: this test is what verifies them."""
    why_not = _backend_usable(backend)
    if why_not:
        pytest.skip(why_not)
    from kvllm.attention.registry import get_backend_class

    backend_class = get_backend_class(backend)
    if backend_class.cudagraph_support == "never":
        monkeypatch.setattr(backend_class, "cudagraph_support", "decode_only")
    rng = random.Random(1)
    lengths = [1, 5, 17, 64, 130, 300, 511, 9, 33, 700, 2, 80]
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in lengths]
    # Different lengths: the batch shrinks through many graph sizes (12 -> 1) and is padded.
    max_tokens = [40 - 3 * i for i in range(len(prompts))]
    eager, eager_replays = _run(qwen3_small, backend, True, prompts, max_tokens)
    graphs, replays = _run(qwen3_small, backend, False, prompts, max_tokens)
    # (decode-graph replays, piecewise replays): the first step's 1,852 prompt tokens run piecewise
    assert eager_replays == (0, 0) and replays[0] > 0 and replays[1] > 0
    report = []
    for prompt, (ref_ids, ref_lps), (ids, _) in zip(prompts, eager, graphs):
        step = next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), None)
        entry = {"prompt_len": len(prompt), "tokens": len(ref_ids), "first_difference": step}
        if step is not None:
            values = sorted((lp.logprob for lp in ref_lps[step].values()), reverse=True)
            entry["eager_top2_gap"] = values[0] - values[1]
        report.append(entry)
    if out_dir := os.environ.get("KVLLM_GPU_REPORT_DIR"):
        with open(os.path.join(out_dir, f"graphs_vs_eager_{backend}.json"), "w") as f:
            json.dump(
                {
                    "backend": backend,
                    "graph_replays": replays[0],
                    "piecewise_replays": replays[1],
                    "prompts": report,
                },
                f,
                indent=1,
            )
    for entry in report:
        assert entry["first_difference"] is None or entry["eager_top2_gap"] < TIE_GAP, entry
    assert sum(e["first_difference"] is not None for e in report) <= 1, report
