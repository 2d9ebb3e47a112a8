"""On a CUDA GPU: structured outputs with CUDA graphs and overlapped scheduling (the GPU defaults).

The mask is applied in the sampler, after the model's graph; with overlap, the masks of step N+1 are
filled after step N's tokens arrive and before N+1 samples. Seeded rows give the same tokens with and
without overlap, and every output validates (random weights + the real Qwen3 tokenizer, temperature 1).
Needs xgrammar and the Qwen3 tokenizer (KVLLM_QWEN3_TOKENIZER on a machine without npm).
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
xgrammar = pytest.importorskip("xgrammar")

from kvllm import LLM, SamplingParams  # noqa: E402
from kvllm.sampling_params import StructuredOutputsParams  # noqa: E402
from tests.e2e.test_structured_outputs import REGEX, SCHEMA, _valid_json  # noqa: E402


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_json_schema_on_the_gpu_with_graphs_and_overlap(tiny_qwen3_real_tokenizer_path, dtype):
    texts = {}
    for async_scheduling in (True, False):
        llm = LLM(
            str(tiny_qwen3_real_tokenizer_path),
            dtype=dtype,
            max_model_len=256,
            gpu_memory_utilization=0.3,
            async_scheduling=async_scheduling,
        )
        assert llm.llm_engine.executor.worker.model_runner.graph_runner is not None  # graphs are on
        params = [
            SamplingParams(
                temperature=1.0,
                seed=i,
                max_tokens=120,
                structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
                if i % 3 == 0
                else StructuredOutputsParams(regex=REGEX)
                if i % 3 == 1
                else None,
            )
            for i in range(64)
        ]
        outs = llm.generate(["Tell me about"] * len(params), params, use_tqdm=False)
        texts[async_scheduling] = [o.outputs[0].text for o in outs]
        del llm
        torch.cuda.empty_cache()
    assert texts[True] == texts[False]
    import re

    assert all(_valid_json(t) for t in texts[True][0::3])
    assert all(re.fullmatch(REGEX, t) for t in texts[True][1::3])
    assert not any(_valid_json(t) for t in texts[True][2::3])
    json.dumps(texts)  # text, not bytes
