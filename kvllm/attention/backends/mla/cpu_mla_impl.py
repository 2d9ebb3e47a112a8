"""CPU_MLA implementation: the decode part gathers each request's latent pages and attends in torch."""

from __future__ import annotations

import torch

from kvllm.attention.backends.mla.common_impl import MLAAttentionImpl, MLADecodeMetadata, MLALayer


class CpuMLAImpl(MLAAttentionImpl):
    """Decode as one padded batch: [B, H, L + R] queries against [B, S, L + R] latents, masked past each
    request's length; values are the first kv_lora_rank entries of the latent."""

    def forward_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, md: MLADecodeMetadata, layer: MLALayer
    ) -> torch.Tensor:
        block_size = kv_cache.shape[1]
        max_len = md.max_seq_len
        pos = torch.arange(max_len, device=q.device)
        blocks = md.block_table.long()[:, pos // block_size]
        slots = blocks * block_size + pos % block_size  # [B, S]
        valid = pos[None, :] < md.seq_lens.long()[:, None]
        latent = self.read_latent(kv_cache, slots.clamp_min(0), q.dtype, layer)  # [B, S, L + R]
        scores = torch.matmul(q.float(), latent.float().transpose(1, 2)) * self.scale  # [B, H, S]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, latent[..., : self.kv_lora_rank].float()).to(q.dtype)
