"""The HF reference soft-caps Gemma 2's attention logits whatever transformers' default implementation is.

On the H200 machine (transformers 5.17) HF ran the tiny Gemma 2 without its attention soft-cap: HF
float32 and bfloat16 agreed with each other, and the engine (which caps) was off by exactly the cap's
effect (step-0 logprob errors 1.045 / 1.195 / 1.858 for prompts of 7 / 33 / 100 tokens; HF capped vs
uncapped on the CPU: 1.046 / 1.171 / 1.858). Here the default is made sdpa, as it was there.
"""

from __future__ import annotations

import pytest
import torch

from tests import model_factory
from tests.hf_reference import _hf_model, reference_attn_implementation


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> str:
    return str(model_factory.make_tiny_gemma2(tmp_path_factory.mktemp("gemma2")))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits[0].float()


def test_reference_soft_caps_gemma2_when_the_default_is_sdpa(gemma2, monkeypatch):
    from transformers import AutoModelForCausalLM
    from transformers.models.gemma2 import modeling_gemma2

    monkeypatch.setattr(modeling_gemma2.Gemma2PreTrainedModel, "_supports_sdpa", True)
    ids = torch.tensor(
        [[int(t) for t in torch.randint(3, 400, (12,), generator=torch.Generator().manual_seed(1))]]
    )
    reference = _hf_model.__wrapped__(gemma2, torch.float32, "cpu")
    assert reference.config._attn_implementation == "eager"
    eager = AutoModelForCausalLM.from_pretrained(
        gemma2, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    torch.testing.assert_close(_logits(reference, ids), _logits(eager, ids), rtol=0, atol=0)
    for layer in eager.model.layers:  # the cap matters for this model: an uncapped run is far off
        layer.self_attn.attn_logit_softcapping = None
    assert (_logits(reference, ids) - _logits(eager, ids)).abs().max() > 0.1


def test_other_models_keep_the_default(tmp_path):
    assert reference_attn_implementation(str(model_factory.make_tiny_gemma3(tmp_path / "g3"))) is None
