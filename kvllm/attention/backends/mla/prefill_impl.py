"""TORCH_SDPA: MLA prefill with torch's scaled_dot_product_attention, one prefill request at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvllm.attention.backends.mla.common_impl import MLAPrefillImpl, MLAPrefillMetadata


class TorchSDPAPrefill(MLAPrefillImpl):
    """Causal SDPA per request with the bottom-right aligned mask (query i at position context + i).

    A step has few prefill requests (chunks of long prompts), so the Python loop is over requests, not
    tokens; torch picks its kernel for the unequal qk / v head sizes.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: MLAPrefillMetadata, scale: float
    ) -> torch.Tensor:
        out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype, device=q.device)
        qs, ks = md.query_start_loc_cpu, md.kv_start_loc_cpu
        for r in range(md.num_prefills):
            q_r = q[qs[r] : qs[r + 1]].transpose(0, 1)  # [H, n, D]
            k_r = k[ks[r] : ks[r + 1]].transpose(0, 1)
            v_r = v[ks[r] : ks[r + 1]].transpose(0, 1)
            n, s = q_r.shape[1], k_r.shape[1]
            if n == s:  # no context: plain causal, no mask tensor (and torch's fused kernels)
                o = F.scaled_dot_product_attention(q_r, k_r, v_r, is_causal=True, scale=scale)
            else:
                q_pos = torch.arange(s - n, s, device=q.device)[:, None]
                mask = torch.arange(s, device=q.device)[None, :] <= q_pos
                o = F.scaled_dot_product_attention(q_r, k_r, v_r, attn_mask=mask, scale=scale)
            out[qs[r] : qs[r + 1]] = o.transpose(0, 1)
        return out
