"""Medusa heads from FasterDecoding's format: both tensor namings, the forward pass against a plain
float32 computation, and errors for weights that do not fit."""

from __future__ import annotations

import json

import pytest
import torch

from kvllm.config.speculative import SpeculativeConfig
from kvllm.spec_decode.medusa import MedusaHeads, MedusaProposer

H, V = 16, 40


def _tensors(num_heads: int, num_layers: int, prefix: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(num_heads):
        for j in range(num_layers):
            out[f"{prefix}{i}.{j}.linear.weight"] = torch.randn(H, H, generator=g)
            out[f"{prefix}{i}.{j}.linear.bias"] = torch.randn(H, generator=g)
        out[f"{prefix}{i}.{num_layers}.weight"] = torch.randn(V, H, generator=g)
    return out


def _reference(
    tensors: dict[str, torch.Tensor], prefix: str, hidden: torch.Tensor, num_heads: int, num_layers: int
):
    drafts = []
    for i in range(num_heads):
        x = hidden.double()
        for j in range(num_layers):
            w, b = (
                tensors[f"{prefix}{i}.{j}.linear.weight"].double(),
                tensors[f"{prefix}{i}.{j}.linear.bias"].double(),
            )
            y = x @ w.T + b
            x = x + y * torch.sigmoid(y)
        drafts.append((x @ tensors[f"{prefix}{i}.{num_layers}.weight"].double().T).argmax(dim=-1))
    return torch.stack(drafts, dim=1)


@pytest.mark.parametrize(("prefix", "suffix"), [("medusa_head.", "safetensors"), ("", "pt")])
def test_heads_load_and_draft_like_the_definition(tmp_path, prefix, suffix):
    tensors = _tensors(3, 2, prefix)
    if suffix == "pt":
        torch.save(tensors, tmp_path / "medusa_lm_head.pt")
    else:
        from safetensors.torch import save_file

        save_file(tensors, tmp_path / "medusa_lm_head.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2}))
    config = SpeculativeConfig.from_value(
        {"method": "medusa", "model": str(tmp_path), "num_speculative_tokens": 2}
    )
    proposer = MedusaProposer(config, H, V, torch.float32, torch.device("cpu"))
    hidden = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    assert proposer.propose(hidden) == _reference(tensors, prefix, hidden, 2, 2).tolist()


def test_weights_that_do_not_fit_are_named():
    heads = MedusaHeads(2, 1, H, V)
    tensors = _tensors(2, 1, "medusa_head.")
    bad = dict(tensors, **{"medusa_head.0.1.weight": torch.zeros(V + 1, H)})
    with pytest.raises(
        ValueError, match=r"'medusa_head.0.1.weight' has shape \(41, 16\), expected \(40, 16\)"
    ):
        heads.load_state(bad)
    with pytest.raises(ValueError, match="missing lm_heads.1.weight"):
        heads.load_state({k: v for k, v in tensors.items() if k != "medusa_head.1.1.weight"})
    with pytest.raises(ValueError, match="beyond medusa_num_heads=2"):
        heads.load_state(dict(tensors, **{"medusa_head.2.1.weight": torch.zeros(V, H)}))


def test_more_drafts_than_heads_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    config = SpeculativeConfig.from_value(
        {"method": "medusa", "model": str(tmp_path), "num_speculative_tokens": 3}
    )
    with pytest.raises(ValueError, match="draft at most medusa_num_heads=2 tokens"):
        MedusaProposer(config, H, V, torch.float32, torch.device("cpu"))
