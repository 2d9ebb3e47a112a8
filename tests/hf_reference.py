"""HF transformers as the reference: greedy continuations and their logprobs, one prompt at a time."""

from __future__ import annotations

from functools import cache

import torch


def reference_attn_implementation(path: str) -> str | None:
    """The HF attention implementation the reference must run: "eager" for models with attention
    logit soft-capping (Gemma 2), None (transformers' default) otherwise.

    transformers' default (sdpa where a model allows it) cannot soft-cap, and some releases let Gemma 2
    take it anyway: on the H200 machine (transformers 5.17) HF float32 and bfloat16 both ran Gemma 2
    uncapped, agreeing with each other and not with the engine. Eager applies the cap in every release.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    config = getattr(config, "text_config", None) or config
    return "eager" if getattr(config, "attn_logit_softcapping", None) else None


@cache
def _hf_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if implementation := reference_attn_implementation(path):
        kwargs["attn_implementation"] = implementation
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()


@torch.inference_mode()
def hf_greedy(
    path: str,
    prompt_ids: list[int],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[list[int], list[float], list[torch.Tensor]]:
    """Greedy tokens, their logprobs, and each step's full logits (float32), without stopping at EOS."""
    model = _hf_model(path, dtype, device)
    ids = torch.tensor([prompt_ids], device=device)
    out = model(ids, use_cache=True)
    past = out.past_key_values
    logits = out.logits[0, -1].float()
    tokens, logprobs, all_logits = [], [], []
    for _ in range(max_new_tokens):
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        all_logits.append(logits.cpu())
        out = model(torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    return tokens, logprobs, all_logits
