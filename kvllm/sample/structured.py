"""The structured-output hook of the sampler: the grammar's token bitmask applied to the logits.

Runs on the logits' device after the model (and outside its CUDA graph), before every other logits
processor, so reported logprobs are those of the constrained distribution, as in vLLM. On CUDA the
mask is xgrammar's own kernel (its Triton backend: one launch that writes only the forbidden entries).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GrammarBitmaskInputs:
    """The packed allowed-token bits of every sampled row (all bits set on unconstrained rows)."""

    bitmask: torch.Tensor  # int32 [N, ceil(V / 32)] on the device; bit j of word w is token 32 w + j


_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def _byte_bits(device: torch.device) -> torch.Tensor:
    """bool [256, 8]: bit j of byte value b (one table per device)."""
    table = _BYTE_BITS.get(device)
    if table is None:
        values = torch.arange(256, device=device).unsqueeze(1)
        table = _BYTE_BITS[device] = ((values >> torch.arange(8, device=device)) & 1).bool()
    return table


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [G, vocab_size]: True where the token is allowed.

    The int32 words are read as little-endian bytes (byte k of a row holds tokens 8k..8k+7), so one
    table lookup per byte unpacks them, several times faster than shifting each word 32 times."""
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous()
    allowed = _byte_bits(bitmask.device)[bitmask.view(torch.uint8).long()].flatten(1)
    if allowed.shape[1] < vocab_size:  # logits wider than the grammar's vocabulary: the rest is banned
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed[:, :vocab_size]


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarBitmaskInputs) -> torch.Tensor:
    """The logits with -inf wherever a row's grammar forbids the token (a new tensor: the model's
    logits are left as they were). Tokens past the grammar's vocabulary are forbidden.

    On CUDA: a copy in the logits' dtype masked by xgrammar's Triton kernel, which reads the packed
    bits and writes only the forbidden entries; elsewhere float32 logits through a bool mask."""
    if logits.is_cuda:
        import xgrammar as xgr

        masked = logits.clone()
        grammar_vocab = min(grammar.bitmask.shape[1] * 32, logits.shape[-1])
        xgr.apply_token_bitmask_inplace(masked, grammar.bitmask, vocab_size=grammar_vocab, backend="triton")
        masked[:, grammar_vocab:] = float("-inf")
        return masked
    disallowed = ~unpack_bitmask(grammar.bitmask, logits.shape[-1])
    return logits.float().masked_fill(disallowed, float("-inf"))
