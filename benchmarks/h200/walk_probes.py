"""Library probes of the conformance walk: what FlashInfer 0.5.3 and FlashAttention can do on this GPU
beyond what kvllm's backends use today, each against the float32 reference. One dict per probe.

- FlashInfer sinks on SM 9.0: `xqa_batch_decode_with_kv_cache(sinks=...)` (the XQA decode kernel)
  and `BatchAttentionWithAttentionSinkWrapper` (the AttentionSink variant of the FA3 prefill
  kernel, for decode and prefill), on kvllm's FLASHINFER cache layout (pages, 2, page, kv heads, dim).
- FlashAttention: FA4 with an fp8 KV cache (its interface asserts SM 10.x for fp8), and which
  FlashAttention builds load beside this torch (FA2 `flash_attn_2_cuda`, FA3 `flash_attn_interface`,
  FA4 `flash_attn.cute`, torch's own `list_flash_attention_impls`).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK = 16, 8, 128, 16
TOLERANCE = 2e-2  # max |err| / max |ref| in bf16, as the GPU tests


def _probe(name: str, fn: Callable[[], dict]) -> dict:
    start = time.monotonic()
    try:
        detail = fn()
        status = detail.pop("status", "pass")
    except Exception as exc:  # the probe's answer may be "it does not run"
        detail, status = {"detail": f"{type(exc).__name__}: {str(exc)[:300]}"}, "error"
    return {"probe": name, "status": status, "seconds": round(time.monotonic() - start, 2), **detail}


def _batch(query_lens: list[int], context_lens: list[int]):
    """A bf16 paged batch, its whole context written into a FlashInfer-layout cache, and sinks."""
    import torch

    from kvllm.attention.reference import make_paged_batch
    from kvllm.attention.testing import random_sinks

    batch = make_paged_batch(query_lens, context_lens, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK,
                             dtype=torch.bfloat16, device="cuda", seed=0)  # fmt: skip
    cache = torch.zeros(
        batch.num_blocks, 2, BLOCK, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device="cuda"
    )
    for r, seq_len in enumerate(batch.seq_lens):
        blocks, offsets = batch.pages(r, torch.arange(seq_len, device="cuda"))
        cache[blocks, 0, offsets] = batch.keys[r]
        cache[blocks, 1, offsets] = batch.values[r]
    return batch, cache, random_sinks(NUM_HEADS, 1, "cuda")


def _error(out, batch, sinks) -> dict:
    ref = batch.reference(HEAD_SIZE**-0.5, causal=True, sinks=sinks)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    no_sink = batch.reference(HEAD_SIZE**-0.5, causal=True)
    err_without = ((out.float() - no_sink).abs().max() / no_sink.abs().max()).item()
    return {
        "status": "pass" if err < TOLERANCE else "fail",
        "rel_max_error": err,
        "rel_max_error_vs_no_sink_reference": err_without,  # large: the sinks did act
        "tolerance": TOLERANCE,
    }


def flashinfer_sink_probes(deadline: float) -> list[dict]:
    import torch

    def xqa_decode() -> dict:
        from flashinfer.decode import xqa_batch_decode_with_kv_cache

        batch, cache, sinks = _batch([1] * 6, [0, 15, 31, 80, 130, 999])
        md = batch.metadata
        workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
        out = xqa_batch_decode_with_kv_cache(
            batch.query, cache, workspace, md.block_table, md.seq_lens, md.max_seq_len,
            bmm1_scale=HEAD_SIZE**-0.5, bmm2_scale=1.0, sinks=sinks, kv_layout="NHD",
        )  # fmt: skip
        torch.cuda.synchronize()
        return _error(out, batch, sinks)

    def sink_wrapper(query_lens: list[int], context_lens: list[int]) -> Callable[[], dict]:
        def run() -> dict:
            from flashinfer import BatchAttentionWithAttentionSinkWrapper

            batch, cache, sinks = _batch(query_lens, context_lens)
            md = batch.metadata
            pages = [-(-s // BLOCK) for s in batch.seq_lens]
            kv_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
            kv_indices = torch.cat([md.block_table[r, :n].cpu() for r, n in enumerate(pages)])
            last = torch.tensor(
                [s - (n - 1) * BLOCK for s, n in zip(batch.seq_lens, pages)], dtype=torch.int32
            )
            workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
            wrapper = BatchAttentionWithAttentionSinkWrapper(
                workspace, "NHD", backend="fa3", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                head_dim_qk=HEAD_SIZE, head_dim_vo=HEAD_SIZE,
            )  # fmt: skip
            wrapper.plan(
                md.query_start_loc_cpu.cuda(), kv_indptr.cuda(), kv_indices.cuda(), last.cuda(),
                NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK, causal=True,
                q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
            )  # fmt: skip
            out = wrapper.run(batch.query, cache, sinks, HEAD_SIZE**-0.5)
            torch.cuda.synchronize()
            return _error(out, batch, sinks)

        return run

    probes = [
        ("flashinfer_xqa_decode_sinks_sm90", xqa_decode),
        ("flashinfer_sink_wrapper_fa3_decode", sink_wrapper([1] * 6, [0, 15, 31, 80, 130, 999])),
        ("flashinfer_sink_wrapper_fa3_mixed", sink_wrapper([1, 1, 37, 5, 70], [31, 130, 0, 57, 19])),
    ]
    rows = []
    for name, fn in probes:
        if time.monotonic() > deadline:
            rows.append({"probe": name, "status": "not_run", "detail": "deadline reached"})
        else:
            rows.append(_probe(name, fn))
    return rows


def flash_attn_probes() -> list[dict]:
    import torch

    def loads(module: str) -> Callable[[], dict]:
        def run() -> dict:
            mod = importlib.import_module(module)
            return {"status": "loads", "detail": getattr(mod, "__file__", "") or ""}

        return run

    def torch_impls() -> dict:
        from torch.nn.attention import list_flash_attention_impls

        return {"status": "info", "detail": str(list_flash_attention_impls())}

    def fa4_fp8_kv() -> dict:
        from flash_attn.cute import flash_attn_varlen_func

        batch, cache, _ = _batch([1, 1, 37], [31, 130, 0])
        md = batch.metadata
        fp8 = torch.float8_e4m3fn
        key_cache, value_cache = cache[:, 0].to(fp8), cache[:, 1].to(fp8)
        out = flash_attn_varlen_func(
            batch.query.to(fp8), key_cache, value_cache, cu_seqlens_q=md.query_start_loc,
            seqused_k=md.seq_lens, max_seqlen_q=md.max_query_len, page_table=md.block_table, causal=True,
        )  # fmt: skip
        out = out[0] if isinstance(out, tuple) else out
        torch.cuda.synchronize()
        ref = batch.reference(HEAD_SIZE**-0.5, causal=True)
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        return {"status": "pass" if err < 0.1 else "fail", "rel_max_error": err, "tolerance": 0.1}

    return [
        _probe("torch_flash_attention_impls", torch_impls),
        _probe("fa2_flash_attn_2_cuda_loads", loads("flash_attn_2_cuda")),
        _probe("fa3_flash_attn_interface_loads", loads("flash_attn_interface")),
        _probe("fa4_flash_attn_cute_loads", loads("flash_attn.cute")),
        _probe("fa4_fp8_kv_sm90", fa4_fp8_kv),
    ]
