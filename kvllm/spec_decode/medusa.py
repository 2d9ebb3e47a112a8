"""Medusa heads (vLLM's `medusa` method), from the published format of FasterDecoding/Medusa.

A heads folder has `config.json` (`medusa_num_heads`, `medusa_num_layers`, and `hidden_size` /
`vocab_size` or the base model's) and the weights, `medusa_lm_head.safetensors` or
`medusa_lm_head.pt` (or any `*.safetensors` / `*.bin`), named `[medusa_head.]I.J.linear.{weight,bias}`
for the ResBlocks (J < medusa_num_layers: x + SiLU(W x + b)) and `[medusa_head.]I.L.weight` for head
I's vocabulary projection (L = medusa_num_layers). Head I, applied to the target's last hidden state
h_t (whose own logits gave token t + 1), predicts token t + 2 + I; the first k heads' argmaxes are
the k drafts after the token the step emitted. Deterministic drafts: the rejection sampler verifies
them with q one-hot, so the output keeps the target's distribution.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.config.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")


class MedusaHeads(nn.Module):
    """medusa_num_heads heads of medusa_num_layers ResBlocks and a vocabulary projection each."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
            for _ in range(num_heads)
        )
        self.lm_heads = nn.ModuleList(
            nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads)
        )

    def forward(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """int64 [N, num_heads]: each head's argmax for each hidden state."""
        drafts = []
        for blocks, lm_head in zip(self.blocks[:num_heads], self.lm_heads[:num_heads]):
            x = hidden
            for linear in blocks:
                x = x + F.silu(linear(x))
            drafts.append(lm_head(x).argmax(dim=-1))
        return torch.stack(drafts, dim=1)

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill from FasterDecoding-named tensors; every parameter must be given, and nothing else."""
        filled = set()
        params = dict(self.named_parameters())
        for name, tensor in tensors.items():
            match = _NAME.match(name)
            if match is None:
                raise ValueError(
                    f"Medusa weights: unexpected tensor {name!r} (expected medusa_head.I.J.linear.weight ...)"
                )
            head, layer, kind = int(match[1]), int(match[2]), match[3]
            if layer < self.num_layers:
                target = f"blocks.{head}.{layer}.{kind}"
            elif layer == self.num_layers and kind == "weight":
                target = f"lm_heads.{head}.weight"
            else:
                raise ValueError(
                    f"Medusa weights: {name!r} does not fit {self.num_layers} ResBlock layers per head"
                )
            if target not in params:
                raise ValueError(
                    f"Medusa weights: {name!r} names head {head}, beyond medusa_num_heads={self.num_heads}"
                )
            if params[target].shape != tensor.shape:
                raise ValueError(
                    f"Medusa weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[target].shape)}"
                )
            with torch.no_grad():
                params[target].copy_(tensor)
            filled.add(target)
        missing = sorted(set(params) - filled)
        if missing:
            raise ValueError(
                f"Medusa weights: missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
            )


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    files = sorted([*folder.glob("*.pt"), *folder.glob("*.bin")])
    if not files:
        raise ValueError(f"Medusa heads folder {str(folder)!r} has no *.safetensors, *.pt or *.bin weights")
    out = {}
    for f in files:
        out.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return out


class MedusaProposer:
    """The heads on the target's device (worker side)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        hidden_size: int,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        folder = Path(config.model or "")
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"speculative_config.model={config.model!r}: Medusa heads are read from a local folder with "
                "config.json and medusa_lm_head.safetensors (FasterDecoding/Medusa's format)"
            )
        cfg = json.loads((folder / "config.json").read_text())
        num_heads = int(cfg.get("medusa_num_heads", cfg.get("num_heads", 0)))
        num_layers = int(cfg.get("medusa_num_layers", cfg.get("num_hidden_layers", 1)))
        if num_heads < 1:
            raise ValueError(f"{folder / 'config.json'}: medusa_num_heads is missing")
        self.k = config.num_speculative_tokens
        if self.k > num_heads:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={self.k}: the Medusa heads in {str(folder)!r} draft at "
                f"most medusa_num_heads={num_heads} tokens"
            )
        for key, ours in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
            theirs = cfg.get(key)
            if theirs is not None and int(theirs) != ours:
                raise ValueError(
                    f"Medusa heads: {key}={theirs} in {folder / 'config.json'}, the target has {ours}"
                )
        heads = MedusaHeads(num_heads, num_layers, hidden_size, vocab_size)
        heads.load_state(_read_tensors(folder))
        self.heads = heads.to(device=device, dtype=dtype).eval()
        logger.info(
            "Medusa: %d heads of %d ResBlocks from %s; %d drafts per step",
            num_heads,
            num_layers,
            folder,
            self.k,
        )

    def propose(self, hidden: torch.Tensor) -> list[list[int]]:
        """k drafts per row of `hidden` (the target's hidden state that gave each request's last token)."""
        return self.heads(hidden, self.k).tolist()
