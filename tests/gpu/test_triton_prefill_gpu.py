"""TRITON_ATTN's prefill kernel on a CUDA GPU (bf16 / fp16) against the float32 reference.

Run on the H200: `PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_triton_prefill_gpu.py`.
Tolerances and their derivation as in test_triton_attention_gpu.py (bf16 1e-2 relative / 6e-2 max
abs, fp16 2e-3 / 1e-2): the kernel differs from the reference by the rounding of P and the output.
The batch has decodes (the unified kernel), a long prefill from scratch, a chunk over a long
cached prefix and a short chunk, so the prefill kernel meets whole, diagonal and window tiles.
"""

from __future__ import annotations

import pytest
import torch

from kvllm.attention.ops.triton_prefill_attention import prefill_attention
from kvllm.attention.ops.triton_prefill_config import PrefillConfig, resolve_kv_load

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOLERANCE = {torch.float16: (2e-3, 1e-2), torch.bfloat16: (1e-2, 6e-2)}
QUERY_LENS = [1, 1, 300, 1024, 77]
CONTEXT_LENS = [500, 40, 0, 1500, 3000]


@pytest.fixture(autouse=True)
def _exact_reference():
    torch.backends.cuda.matmul.allow_tf32 = False


def run(*args, **kwargs):
    from kvllm.attention.testing import run_triton_case

    return run_triton_case(*args, device="cuda", **kwargs)


def check(case, dtype: torch.dtype) -> None:
    rel_tol, abs_tol = TOLERANCE[dtype]
    assert not torch.isnan(case.out).any(), "some output rows were not written"
    assert case.rel_error() < rel_tol, f"relative error {case.rel_error():.2e} >= {rel_tol}"
    assert case.max_abs_error() < abs_tol, f"max abs error {case.max_abs_error():.2e} >= {abs_tol}"


@pytest.mark.parametrize(
    "dtype,num_heads,num_kv_heads,block_size",
    [
        (torch.bfloat16, 16, 8, 16),
        (torch.bfloat16, 16, 8, 64),
        (torch.bfloat16, 32, 8, 16),
        (torch.bfloat16, 32, 8, 64),
        (torch.bfloat16, 28, 4, 16),
        (torch.bfloat16, 28, 4, 128),
        (torch.float16, 16, 8, 16),
        (torch.float16, 16, 8, 64),
    ],
    ids=["bf16-qwen3-b16", "bf16-qwen3-b64", "bf16-llama-b16", "bf16-llama-b64", "bf16-g7-b16", "bf16-g7-b128",
         "fp16-qwen3-b16", "fp16-qwen3-b64"],
)  # fmt: skip
def test_table_config(dtype, num_heads, num_kv_heads, block_size) -> None:
    """The config table's choice (prefill_config=None: the mean query length selects the kernel)."""
    check(run(QUERY_LENS, CONTEXT_LENS, num_heads, num_kv_heads, 128, block_size, dtype), dtype)


@pytest.mark.parametrize(
    "sliding_window,logits_soft_cap,use_sinks",
    [(128, None, False), (None, 30.0, False), (None, None, True), (1024, 50.0, True)],
    ids=["window", "softcap", "sinks", "all"],
)
def test_features_tma(sliding_window, logits_soft_cap, use_sinks) -> None:
    """Block 64: the table's TMA loads with every declared feature (block 16 is in test_triton_attention_gpu)."""
    case = run(QUERY_LENS, CONTEXT_LENS, 32, 4, 128, 64, torch.bfloat16, sliding_window=sliding_window,
               logits_soft_cap=logits_soft_cap, use_sinks=use_sinks)  # fmt: skip
    check(case, torch.bfloat16)


@pytest.mark.parametrize("kv_cache_dtype,block_size", [("fp8_e4m3", 64), ("fp8_e5m2", 16)])
def test_fp8_kv_cache(kv_cache_dtype, block_size) -> None:
    case = run(QUERY_LENS, CONTEXT_LENS, 16, 8, 128, block_size, torch.bfloat16, kv_cache_dtype=kv_cache_dtype,
               k_scale=0.37, v_scale=1.7, use_sinks=True)  # fmt: skip
    check(case, torch.bfloat16)


def test_tma_stale_page_tails() -> None:
    """TMA reads whole tiles: NaN past the sequence end inside the last page must not reach the output."""
    from kvllm.attention.reference import make_paged_batch, reference_attention

    query_lens, context_lens, block_size = [700, 333], [0, 91], 64
    batch = make_paged_batch(query_lens, context_lens, 16, 8, 128, block_size, dtype=torch.bfloat16,
                             device="cuda", seed=5)  # fmt: skip
    caches = torch.full(
        (2, batch.num_blocks, block_size, 8, 128), float("nan"), dtype=torch.bfloat16, device="cuda"
    )
    for r, (k, v) in enumerate(zip(batch.keys, batch.values)):
        blocks, offsets = batch.pages(r, torch.arange(k.shape[0], device="cuda"))
        caches[0, blocks, offsets] = k
        caches[1, blocks, offsets] = v
    md = batch.metadata
    out = torch.full_like(batch.query, float("nan"))
    cfg = PrefillConfig(128, 64, 8, 3, kv_load="tma")
    assert resolve_kv_load(cfg, caches[0], caches[1], 128) == "tma"
    prefill_attention(
        out, batch.query, caches[0], caches[1], md.query_start_loc, md.seq_lens, md.block_table,
        seq_lo=0, seq_hi=md.num_reqs, num_tokens=md.num_actual_tokens, scale=128**-0.5, cfg=cfg,
    )  # fmt: skip
    ref = reference_attention(batch.query, batch.keys, batch.values, query_lens, 128**-0.5)
    assert not torch.isnan(out).any()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < TOLERANCE[torch.bfloat16][0], f"relative error {err:.2e}"


FAMILIES = {  # warp-specialized ones last: a compiler hang there cannot hide the others' results
    "gather": (PrefillConfig(128, 64, 8, 3), 16),
    "pack": (PrefillConfig(128, 64, 8, 3, pack_gqa=True), 16),
    "n128": (PrefillConfig(128, 128, 8, 2), 16),
    "m64-w4": (PrefillConfig(64, 64, 4, 3), 16),
    "newkv-n128": (PrefillConfig(128, 128, 8, 2, new_kv=True), 16),
    "newkv-pack": (PrefillConfig(128, 64, 8, 3, pack_gqa=True, new_kv=True), 16),
    "page": (PrefillConfig(128, 64, 8, 3, kv_load="page"), 64),
    "tma-pack": (PrefillConfig(128, 64, 8, 3, kv_load="tma", pack_gqa=True), 64),
    "ws": (PrefillConfig(128, 64, 8, 3, warp_specialize=True), 16),
    "newkv-ws": (PrefillConfig(128, 64, 8, 3, warp_specialize=True, new_kv=True), 16),
    "tma-ws": (PrefillConfig(128, 64, 8, 3, kv_load="tma", warp_specialize=True), 64),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sweep_families(family) -> None:
    """One member of each candidate family of benchmarks/h200/prefill_sweep.py."""
    cfg, block_size = FAMILIES[family]
    check(
        run(QUERY_LENS, CONTEXT_LENS, 16, 8, 128, block_size, torch.bfloat16, prefill_config=cfg),
        torch.bfloat16,
    )
