"""The peer kernels of the attention benchmark: TRITON_ATTN through its own ops (with tile sweeps)
and its KV write, torch SDPA, compiled FlexAttention, FlashAttention-4 and the FlashInfer library.

Each peer is set up on the shape's batch and cache and returns (fn, out, bytes, note): `fn` runs the
timed call, `out` receives its output (checked against the reference first), `bytes` replaces the
KV bytes in the TB/s column (None: the shape's), `note` goes in the row. A peer that cannot run
here is a "skipped: ..." string instead.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Any

PEERS = ("triton", "triton-kv-write", "sdpa", "flex", "fa4", "flashinfer")


@dataclass
class Peers:
    """The peers for one benchmark run (dtype, device and the CLI's shape flags)."""

    args: argparse.Namespace
    dtype: Any  # torch.dtype; torch is imported on use
    device: Any
    on_gpu: bool

    def runners(self, peer, batch, kv_cache, k_scale, scale) -> list[tuple[str, object]]:
        gpu_only = "skipped: GPU-only peer (no CUDA device)"
        if peer == "triton":
            out = [("TRITON_ATTN", lambda: self._triton(batch, kv_cache, k_scale, scale, None))]
            if self.args.sweep:
                for dec, pre in _sweep_configs(
                    batch.metadata.num_decodes > 0, batch.metadata.num_prefills > 0
                ):
                    label = f"TRITON_ATTN {_cfg_text(dec, pre)}"
                    out.append(
                        (label, lambda d=dec, p=pre: self._triton(batch, kv_cache, k_scale, scale, (d, p)))
                    )
            return out
        if peer == "triton-kv-write":
            return [("TRITON_ATTN kv-write", lambda: self._kv_write(batch, kv_cache, k_scale))]
        if peer == "sdpa":
            if self.args.kv_cache_dtype != "auto":
                return [("SDPA", "skipped: no fp8 KV cache")]
            return [("SDPA flash" if self.on_gpu else "SDPA (cpu default)", lambda: self._sdpa(batch, scale))]
        if peer == "flex":
            if not self.on_gpu:
                return [("FlexAttention", gpu_only)]
            if self.args.kv_cache_dtype != "auto":
                return [("FlexAttention", "skipped: no fp8 KV cache")]
            return [("FlexAttention compiled", lambda: self._flex(batch, scale))]
        if peer == "fa4":
            why_not = self._library_skip("flash_attn.cute")
            if why_not:
                return [("FA4", why_not)]
            return [("FA4 paged varlen", lambda: self._fa4(batch, kv_cache, scale))]
        if peer == "flashinfer":
            why_not = self._library_skip("flashinfer")
            if why_not:
                return [("FlashInfer", why_not)]
            return [("FlashInfer library", lambda: self._flashinfer(batch, kv_cache, scale))]
        raise SystemExit(f"unknown peer {peer!r} (known: {', '.join(PEERS)})")

    def _library_skip(self, module: str) -> str | None:
        """Why a GPU library peer (16-bit cache only) cannot run here; None when it can."""
        if not self.on_gpu:
            return "skipped: GPU-only peer (no CUDA device)"
        try:
            importlib.import_module(module)
        except Exception as exc:
            return f"skipped: {module} not importable ({type(exc).__name__})"
        if self.args.kv_cache_dtype != "auto":
            return "skipped: fp8 KV cache not set up here"
        return None

    def _triton(self, batch, kv_cache, k_scale, scale, configs):
        import torch

        from kvllm.attention.backends.triton_attn import TritonAttentionBackend
        from kvllm.attention.backends.triton_attn_impl import TritonAttentionMetadataBuilder
        from kvllm.attention.metadata import KVCacheSpec
        from kvllm.attention.ops.triton_unified_attention import unified_attention

        a, md = self.args, batch.metadata
        spec = KVCacheSpec(a.block_size, a.num_kv_heads, a.head_size, kv_cache.dtype, a.kv_cache_dtype)
        builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, self.device, md.num_reqs,
                                                 md.num_actual_tokens, md.max_seq_len + a.block_size)  # fmt: skip
        tm = builder.build(md)
        out = torch.empty_like(batch.query)
        dec, pre = configs or (None, None)

        def fn():
            unified_attention(
                out, batch.query, kv_cache[0], kv_cache[1], tm.query_start_loc, tm.seq_lens, tm.block_table,
                num_reqs=tm.num_reqs, num_tokens=tm.num_actual_tokens, num_decode_reqs=tm.num_decode_reqs,
                scale=scale, k_scale=k_scale, v_scale=k_scale, num_splits=tm.num_splits,
                decode_order=tm.decode_order,
                decode_cfg=dec, prefill_cfg=pre, key=batch.new_keys, value=batch.new_values,
            )  # fmt: skip

        # The step's K/V go in as the engine passes them (the prefill kernel may read them from there).
        order = "" if tm.decode_order is None else ", longest first"
        return fn, out, None, f"splits={tm.num_splits}{order}"

    def _kv_write(self, batch, kv_cache, k_scale):
        from kvllm.attention.ops.triton_reshape_and_cache import reshape_and_cache

        md = batch.metadata

        def fn():
            reshape_and_cache(batch.new_keys, batch.new_values, kv_cache[0], kv_cache[1], md.slot_mapping,
                              k_scale, k_scale)  # fmt: skip

        moved = 2 * batch.new_keys.numel() * (batch.new_keys.element_size() + kv_cache.element_size())
        return fn, batch.new_keys.new_empty(0), moved, "TB/s = K/V bytes read + written"

    def _sdpa(self, batch, scale):
        import contextlib

        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        group = self.args.num_heads // self.args.num_kv_heads
        # Contiguous per-sequence inputs, K/V repeated to the query heads, requests of one group batched.
        calls = []
        start = req = 0
        out = torch.empty_like(batch.query)
        qlens = batch.query_lens
        while req < len(qlens):
            end = req
            while (
                end < len(qlens) and qlens[end] == qlens[req] and batch.seq_lens[end] == batch.seq_lens[req]
            ):
                end += 1
            qlen, seq = qlens[req], batch.seq_lens[req]
            n = end - req
            q = batch.query[start : start + n * qlen].view(n, qlen, *batch.query.shape[1:]).transpose(1, 2)
            k = torch.stack(batch.keys[req:end]).repeat_interleave(group, dim=2).transpose(1, 2).contiguous()
            v = (
                torch.stack(batch.values[req:end])
                .repeat_interleave(group, dim=2)
                .transpose(1, 2)
                .contiguous()
            )
            q = q.contiguous()
            mask = causal_lower_right(qlen, seq) if qlen > 1 and seq > qlen else None
            calls.append((q, k, v, mask, qlen > 1 and seq == qlen, out[start : start + n * qlen], n, qlen))
            start += n * qlen
            req = end
        ctx = (lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)) if self.on_gpu else contextlib.nullcontext

        def fn():
            with ctx():
                for q, k, v, mask, causal, dst, n, qlen in calls:
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
                    dst.copy_(o.transpose(1, 2).reshape(n * qlen, *o.shape[1:2], o.shape[-1]))

        return fn, out, None, "contiguous, K/V repeated to query heads"

    def _flex(self, batch, scale):
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        dev = self.device
        q = batch.query.transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, Tq, D]
        k = torch.cat(batch.keys).transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hkv, Tk, D]
        v = torch.cat(batch.values).transpose(0, 1).unsqueeze(0).contiguous()
        q_doc = torch.repeat_interleave(torch.arange(len(batch.query_lens), device=dev),
                                        torch.tensor(batch.query_lens, device=dev))  # fmt: skip
        k_doc = torch.repeat_interleave(torch.arange(len(batch.seq_lens), device=dev),
                                        torch.tensor(batch.seq_lens, device=dev))  # fmt: skip
        q_off = torch.cat(
            [torch.arange(s - ql, s, device=dev) for ql, s in zip(batch.query_lens, batch.seq_lens)]
        )
        k_off = torch.cat([torch.arange(s, device=dev) for s in batch.seq_lens])

        def mask_mod(b, h, qi, ki):
            return (q_doc[qi] == k_doc[ki]) & (k_off[ki] <= q_off[qi])

        block_mask = create_block_mask(mask_mod, 1, 1, q.shape[2], k.shape[2], device=dev)
        compiled = torch.compile(flex_attention, dynamic=False)
        out = torch.empty_like(batch.query)

        def fn():
            o = compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
            out.copy_(o[0].transpose(0, 1))

        return fn, out, None, "block mask over the logical (contiguous) layout"

    def _fa4(self, batch, kv_cache, scale):
        import torch
        from flash_attn.cute import flash_attn_varlen_func

        md = batch.metadata
        out = torch.empty_like(batch.query)

        def fn():
            res = flash_attn_varlen_func(
                batch.query, kv_cache[0], kv_cache[1], cu_seqlens_q=md.query_start_loc, seqused_k=md.seq_lens,
                max_seqlen_q=md.max_query_len, page_table=md.block_table, causal=True, softmax_scale=scale,
            )  # fmt: skip
            out.copy_(res[0] if isinstance(res, tuple) else res)

        return fn, out, None, "page_table over the same cache"

    def _flashinfer(self, batch, kv_cache, scale):
        """The library alone: its wrappers planned once outside the timing, then run() per call."""
        import flashinfer
        import torch

        md = batch.metadata
        a = self.args
        fi_cache = kv_cache.transpose(0, 1).contiguous()  # FlashInfer's NHD (num_blocks, 2, bs, Hkv, D)
        seq_lens = md.seq_lens.tolist()
        table = md.block_table.tolist()
        pages = [table[r][: (n + a.block_size - 1) // a.block_size] for r, n in enumerate(seq_lens)]

        def page_lists(reqs):
            indptr = [0]
            for r in reqs:
                indptr.append(indptr[-1] + len(pages[r]))
            indices = [p for r in reqs for p in pages[r]]
            last = [(seq_lens[r] - 1) % a.block_size + 1 for r in reqs]
            as_int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=self.device)  # noqa: E731
            return as_int32(indptr), as_int32(indices), as_int32(last)

        num_decodes, num_reqs = md.num_decodes, len(seq_lens)
        qsl = md.query_start_loc.tolist()
        heads = dict(num_qo_heads=a.num_heads, num_kv_heads=a.num_kv_heads, page_size=a.block_size,
                     q_data_type=self.dtype, kv_data_type=kv_cache.dtype, sm_scale=scale)  # fmt: skip
        runs = []
        if num_decodes:
            ws = torch.zeros(128 << 20, dtype=torch.uint8, device=self.device)
            decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
            decode.plan(*page_lists(range(num_decodes)), head_dim=a.head_size, **heads)
            runs.append((decode, 0, qsl[num_decodes]))
        if num_decodes < num_reqs:
            ws = torch.zeros(128 << 20, dtype=torch.uint8, device=self.device)
            prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            qo_indptr = torch.tensor([q - qsl[num_decodes] for q in qsl[num_decodes:]], dtype=torch.int32,
                                     device=self.device)  # fmt: skip
            prefill.plan(qo_indptr, *page_lists(range(num_decodes, num_reqs)), head_dim_qk=a.head_size,
                         causal=True, **heads)  # fmt: skip
            runs.append((prefill, qsl[num_decodes], qsl[-1]))
        out = torch.empty_like(batch.query)

        def fn():
            for wrapper, start, end in runs:
                wrapper.run(batch.query[start:end], fi_cache, out=out[start:end])

        return fn, out, None, "decode + prefill wrappers, planned once (not timed)"


def _sweep_configs(has_decodes: bool, has_prefills: bool):
    from kvllm.attention.ops.triton_unified_attention import KernelConfig

    if has_decodes and not has_prefills:
        for tile_n in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    yield KernelConfig(16, tile_n, warps, stages), None
    if has_prefills and not has_decodes:
        for block_m in (64, 128):
            for tile_n in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3):
                        yield None, KernelConfig(block_m, tile_n, warps, stages)


def _cfg_text(dec, pre) -> str:
    cfg = dec or pre
    kind = "dec" if dec else "pre"
    return f"{kind} M{cfg.block_m} N{cfg.tile_n} w{cfg.num_warps} s{cfg.num_stages}"
