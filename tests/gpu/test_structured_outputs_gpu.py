"""On a CUDA GPU: structured outputs with CUDA graphs and overlapped scheduling (the GPU defaults).

The mask is applied in the sampler, after the model's graph; with overlap, the masks of step N+1 are
filled after step N's tokens arrive and before N+1 samples. Seeded rows give the same tokens with and
without overlap, and every output validates (random weights + the real Qwen3 tokenizer, temperature 1).
Needs xgrammar and the Qwen3 tokenizer (KVLLM_QWEN3_TOKENIZER on a machine without npm).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
xgrammar = pytest.importorskip("xgrammar")

from kvllm import LLM, SamplingParams  # noqa: E402
from kvllm.sampling_params import StructuredOutputsParams  # noqa: E402

# The GPU machine has no jsonschema: the schema is small enough to check by hand.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z][a-z ]{0,7}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"


def _valid_json(text: str) -> bool:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(doc, dict)
        and set(doc) == {"name", "age", "member"}
        and isinstance(doc["name"], str)
        and re.fullmatch(r"[A-Za-z][a-z ]{0,7}", doc["name"]) is not None
        and type(doc["age"]) is int
        and 0 <= doc["age"] <= 120
        and type(doc["member"]) is bool
    )


def test_json_schema_on_the_gpu_with_graphs_and_overlap(tiny_qwen3_real_tokenizer_path):
    """Also with the matchers in the grammar process (--grammar-process), whose shared-memory masks
    must be page-locked in place (not copied into a pinned buffer)."""
    texts = {}
    for async_scheduling, grammar_process in ((True, False), (False, False), (True, True)):
        llm = LLM(
            str(tiny_qwen3_real_tokenizer_path),
            dtype="bfloat16",
            max_model_len=256,
            gpu_memory_utilization=0.3,
            async_scheduling=async_scheduling,
            grammar_process=grammar_process,
        )
        assert llm.llm_engine.executor.worker.model_runner.graph_runner is not None  # graphs are on
        manager = llm.llm_engine.structured_output_manager
        assert manager.pin_memory
        if grammar_process:
            assert manager.grammar_process.masks.is_pinned()
        probe = manager.make_request(StructuredOutputsParams(regex=REGEX))
        for _ in range(60):  # the grammar process answers other messages (its start) first
            if probe.is_ready():
                break
            probe.wait(1.0)
        assert probe.is_ready() and probe.error is None
        # Pinned, so the copy to the GPU does not wait for the forward pass it overlaps.
        assert manager.grammar_bitmask([probe, None]).is_pinned()
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
        texts[async_scheduling, grammar_process] = [o.outputs[0].text for o in outs]
        llm.llm_engine.shutdown()
        del llm
        torch.cuda.empty_cache()
    reference = texts[True, False]
    assert texts[False, False] == reference and texts[True, True] == reference
    assert all(_valid_json(t) for t in reference[0::3])
    assert all(re.fullmatch(REGEX, t) for t in reference[1::3])
    assert not any(_valid_json(t) for t in reference[2::3])
    json.dumps(reference)  # text, not bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [1000, 1000 + 37])  # logits as wide as the grammar, and wider
def test_cuda_mask_equals_the_torch_mask(dtype, width):
    """xgrammar's kernel (the CUDA path) bans exactly what the torch path bans, past the grammar's
    vocabulary included, and leaves the input logits as they were."""
    from kvllm.sample.structured import GrammarBitmaskInputs, apply_grammar_bitmask

    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(5, width, generator=gen).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, (1000 + 31) // 32), generator=gen, dtype=torch.int32)
    expected = apply_grammar_bitmask(logits, GrammarBitmaskInputs(bitmask))  # the CPU path
    cuda_logits = logits.cuda()
    got = apply_grammar_bitmask(cuda_logits, GrammarBitmaskInputs(bitmask.cuda()))
    assert torch.equal(cuda_logits.cpu(), logits)
    assert torch.equal(got.float().cpu(), expected)
