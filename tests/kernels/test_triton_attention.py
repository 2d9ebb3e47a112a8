"""TRITON_ATTN unified attention (with its KV write) against the float32 reference, on the CPU interpreter.

Tolerances (relative L2 error of the whole output, and max abs error; values are O(1)):
- float32: the kernel computes in float32 with IEEE dots, only the summation order differs: 1e-5.
- float16: inputs are the same fp16 values the reference upcasts; the kernel rounds P to fp16 for the
  P.V dot and the output to fp16 (each 2^-11 relative, about 5e-4), so 2e-3 relative / 1e-2 absolute.
- bfloat16 queries (fp8 caches only, whose dots run in fp16): the output is rounded to bf16 (2^-8
  relative) and P to fp16: 1e-2 / 3e-2.
- fp8 caches: the reference reads the same fp8-rounded K/V (stored = value / scale), so fp8 adds no
  error of its own and the tolerances are those of the compute dtype.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from kvllm.attention.backends.triton_attn import TritonAttentionBackend
from kvllm.attention.backends.triton_attn_impl import (
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
    longest_first,
)
from kvllm.attention.metadata import CommonAttentionMetadata, KVCacheSpec
from kvllm.attention.ops.triton_unified_attention import FP8_DOT_MODES, KernelConfig, fp8_dot_mode
from kvllm.attention.reference import make_paged_batch
from kvllm.attention.testing import prepare_backend_case, run_backend_case, run_triton_case

TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 1e-2), torch.bfloat16: (1e-2, 3e-2)}
# Small tiles: many q-blocks and KV tiles per request, so the binary search, tile loops crossing
# page boundaries and the masked/unmasked tile split are all exercised on tiny shapes.
SMALL = KernelConfig(block_m=16, tile_n=16, num_warps=4, num_stages=1)

# Decodes first (one of them with a single cached token), then prefill chunks with and without a prefix.
MIXED_QUERY_LENS = [1, 1, 1, 9, 37]
MIXED_CONTEXT_LENS = [45, 1, 70, 21, 0]


def check(case, dtype: torch.dtype) -> None:
    rel_tol, abs_tol = TOLERANCE[dtype]
    assert not torch.isnan(case.out).any(), "some output rows were not written"
    assert case.rel_error() < rel_tol, f"relative error {case.rel_error():.2e} >= {rel_tol}"
    assert case.max_abs_error() < abs_tol, f"max abs error {case.max_abs_error():.2e} >= {abs_tol}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size",
    [(4, 4, 64, 16), (4, 2, 128, 32), (8, 2, 80, 16), (8, 1, 32, 32), (6, 2, 96, 16)],
    ids=["mha-d64-b16", "gqa2-d128-b32", "gqa4-d80-b16", "mqa8-d32-b32", "gqa3-d96-b16"],
)
@pytest.mark.parametrize("tiles", ["default", "small"])
def test_mixed_batch(dtype, num_heads, num_kv_heads, head_size, block_size, tiles) -> None:
    cfg = SMALL if tiles == "small" else None
    case = run_triton_case(
        MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, num_heads, num_kv_heads, head_size, block_size, dtype,
        decode_config=cfg, prefill_config=cfg,
    )  # fmt: skip
    check(case, dtype)


@pytest.mark.parametrize(
    "sliding_window,logits_soft_cap,use_sinks",
    [(8, None, False), (None, 5.0, False), (None, None, True), (19, 10.0, True), (1, None, True)],
    ids=["window", "softcap", "sinks", "all", "window1-sinks"],
)
@pytest.mark.parametrize("tiles", ["default", "small"])
def test_features(sliding_window, logits_soft_cap, use_sinks, tiles) -> None:
    cfg = SMALL if tiles == "small" else None
    case = run_triton_case(
        MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 8, 2, 64, 16, torch.float16,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, use_sinks=use_sinks,
        decode_config=cfg, prefill_config=cfg,
    )  # fmt: skip
    check(case, torch.float16)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_fp8_kv_cache(kv_cache_dtype, dtype) -> None:
    case = run_triton_case(
        MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 8, 2, 64, 16, dtype,
        kv_cache_dtype=kv_cache_dtype, k_scale=0.37, v_scale=1.7, use_sinks=True,
        decode_config=SMALL, prefill_config=SMALL,
    )  # fmt: skip
    check(case, dtype)


def test_fp8_kv_cache_bf16_query(monkeypatch) -> None:
    """bf16 queries over an fp8 cache run their dots in fp16 (KVLLM_FP8_ATTENTION_DOT's default).

    Only this mode runs here: the interpreter's bf16 dots are wrong by orders of magnitude (bf16 queries
    over a bf16 cache fail the same way), so the bf16-dot mode is checked on the GPU alone."""
    monkeypatch.delenv("KVLLM_FP8_ATTENTION_DOT", raising=False)
    case = run_triton_case(
        MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 8, 2, 64, 16, torch.bfloat16,
        kv_cache_dtype="fp8_e4m3", k_scale=0.37, v_scale=1.7, decode_config=SMALL, prefill_config=SMALL,
    )  # fmt: skip
    check(case, torch.bfloat16)


def test_fp8_dot_mode_in_the_interpreter(monkeypatch) -> None:
    """fp16_registers needs inline assembly, which the interpreter lacks: there it is fp16's arithmetic."""
    monkeypatch.setenv("KVLLM_FP8_ATTENTION_DOT", "fp16_registers")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fp8_dot_mode() == FP8_DOT_MODES["fp16"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert fp8_dot_mode() == FP8_DOT_MODES["fp16_registers"]


def test_fp8_dot_mode_rejects_unknown(monkeypatch) -> None:
    monkeypatch.setenv("KVLLM_FP8_ATTENTION_DOT", "fp4")
    with pytest.raises(ValueError, match="KVLLM_FP8_ATTENTION_DOT='fp4'.*bf16"):
        fp8_dot_mode()


@pytest.mark.parametrize("num_splits", [2, 8])
@pytest.mark.parametrize(
    "sliding_window,use_sinks,kv_cache_dtype",
    [(None, False, "auto"), (100, True, "auto"), (None, True, "fp8_e4m3")],
)
def test_split_kv_decode(num_splits, sliding_window, use_sinks, kv_cache_dtype) -> None:
    # Segments shorter than a tile and longer than several tiles, plus a request with fewer
    # tiles than segments (its extra segments are empty and must drop out of the reduce).
    case = run_triton_case(
        [1, 1, 1, 1, 5], [300, 4, 129, 40, 60], 8, 2, 96, 16, torch.float16,
        sliding_window=sliding_window, use_sinks=use_sinks, kv_cache_dtype=kv_cache_dtype, k_scale=0.5,
        v_scale=2.0, num_splits=num_splits, decode_config=SMALL,
    )  # fmt: skip
    check(case, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_long_prefill_chunk_over_prefix(dtype) -> None:
    """A chunk spanning several default-size q-blocks over a cached prefix (tiles fully unmasked)."""
    case = run_triton_case([1, 150], [10, 200], 4, 2, 64, 16, dtype)
    check(case, dtype)


def test_split_decision() -> None:
    spec = KVCacheSpec(16, 8, 128, torch.float16, "auto")
    builder = TritonAttentionMetadataBuilder(
        TritonAttentionBackend, spec, torch.device("cpu"), 256, 8192, 32768
    )
    builder.num_sms = 132  # plan as on an H200
    assert builder.num_splits_for(256, 1024) == 1  # 2048 programs fill the GPU
    assert builder.num_splits_for(1, 32768) == 64
    assert builder.num_splits_for(8, 8192) == 16
    assert builder.num_splits_for(1, 300) == 1  # too short to be worth a reduce
    assert builder.num_splits_for(0, 4096) == 1


# 20 decodes of ragged lengths (40 programs with 2 KV heads: unsplit on the 16 "SMs" the CPU plans
# with, so the launch is ordered) and one prefill chunk behind them.
RAGGED_QUERY_LENS = [1] * 20 + [7]
RAGGED_CONTEXT_LENS = [3, 90, 17, 64, 1, 120, 33, 48, 75, 9, 101, 26, 58, 12, 83, 40, 5, 111, 70, 19, 30]


def test_decodes_start_longest_first() -> None:
    """The unsplit decode launch gets its requests by descending length; the prefill is not in the order."""
    batch = make_paged_batch(
        RAGGED_QUERY_LENS, RAGGED_CONTEXT_LENS, 4, 2, 64, 16, dtype=torch.float16, seed=3
    )
    spec = KVCacheSpec(16, 2, 64, torch.float16, "auto")
    builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, torch.device("cpu"), 32, 256, 512)
    md = builder.build(batch.metadata)
    assert md.num_splits == 1 and md.num_decode_reqs == 20
    order = md.decode_order.tolist()
    assert sorted(order) == list(range(20))
    lens = [RAGGED_CONTEXT_LENS[i] + 1 for i in order]
    assert lens == sorted(lens, reverse=True) and lens[0] == 121


def test_longest_first_keeps_ties_in_batch_order() -> None:
    """The host sort behind the ordered launch: descending lengths, ties (and padding, length 0) in batch order."""
    lens = np.array([5, 9, 0, 9, 5, 1, 0], dtype=np.int64)
    assert longest_first(lens).tolist() == [1, 3, 0, 4, 5, 2, 6]


def test_decode_order_pads_missing_host_lengths_last() -> None:
    """Requests past the host's lengths count as padding (length 0): the order is still a permutation of every
    decode request, with them last."""
    batch = make_paged_batch(
        RAGGED_QUERY_LENS, RAGGED_CONTEXT_LENS, 4, 2, 64, 16, dtype=torch.float16, seed=3
    )
    spec = KVCacheSpec(16, 2, 64, torch.float16, "auto")
    builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, torch.device("cpu"), 32, 256, 512)
    short = dataclasses.replace(batch.metadata, seq_lens_cpu=batch.metadata.seq_lens_cpu[:15])
    order = builder.build(short).decode_order.tolist()
    assert sorted(order) == list(range(20)) and order[15:] == [15, 16, 17, 18, 19]
    lens = [RAGGED_CONTEXT_LENS[i] + 1 for i in order[:15]]
    assert lens == sorted(lens, reverse=True)


def test_decode_order_setting(monkeypatch) -> None:
    batch = make_paged_batch(
        RAGGED_QUERY_LENS, RAGGED_CONTEXT_LENS, 4, 2, 64, 16, dtype=torch.float16, seed=3
    )
    spec = KVCacheSpec(16, 2, 64, torch.float16, "auto")
    monkeypatch.setenv("KVLLM_TRITON_DECODE_ORDER", "batch")
    builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, torch.device("cpu"), 32, 256, 512)
    assert builder.build(batch.metadata).decode_order is None
    monkeypatch.setenv("KVLLM_TRITON_DECODE_ORDER", "shortest")
    with pytest.raises(ValueError, match="KVLLM_TRITON_DECODE_ORDER='shortest'.*longest_first"):
        TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, torch.device("cpu"), 32, 256, 512)


@pytest.mark.parametrize("order", ["builder", "reversed", "shuffled"])
def test_ordered_decode_launch(order) -> None:
    """Whatever permutation the launch follows, every decode row lands on its own request (float32 reference)."""
    generator = torch.Generator().manual_seed(11)
    permutations = {
        "builder": {},
        "reversed": {"decode_order": torch.arange(19, -1, -1)},
        "shuffled": {"decode_order": torch.randperm(20, generator=generator)},
    }
    case = run_backend_case(
        TritonAttentionBackend, RAGGED_QUERY_LENS, RAGGED_CONTEXT_LENS, 4, 2, 64, 16, torch.float16,
        seed=4, reference="cache", preallocated_output=True, metadata_attrs=permutations[order],
    )  # fmt: skip
    assert case.metadata.decode_order is not None
    check(case, torch.float16)


def test_ordered_decode_launch_follows_the_order() -> None:
    """An order that names request 5 for every program writes request 5's row and no other decode's."""
    case = prepare_backend_case(
        TritonAttentionBackend,
        make_paged_batch(RAGGED_QUERY_LENS, RAGGED_CONTEXT_LENS, 4, 2, 64, 16, dtype=torch.float16, seed=4),
        preallocated_output=True,
        metadata_attrs={"decode_order": torch.full((20,), 5)},
    )
    out = case.forward()
    written = [not torch.isnan(out[i]).any().item() for i in range(20)]
    assert written == [i == 5 for i in range(20)]


def test_kv_cache_dtype_mismatch_is_an_error() -> None:
    """An fp8 kv_cache_dtype with a non-fp8 cache tensor must fail, never silently run unquantized."""
    batch = make_paged_batch([1], [4], 2, 1, 32, 16, dtype=torch.float16, seed=0)
    spec = KVCacheSpec(16, 1, 32, torch.float16, "fp8_e4m3")
    builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, torch.device("cpu"), 1, 1, 64)
    impl = TritonAttentionImpl(2, 32, 1.0, 1, kv_cache_dtype="fp8_e4m3")
    layer = types.SimpleNamespace(k_scale=torch.tensor(1.0), v_scale=torch.tensor(1.0))
    kv_cache = torch.zeros(2, batch.num_blocks, 16, 1, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="does not match the KV cache"):
        impl.forward(
            layer, batch.query, batch.new_keys, batch.new_values, kv_cache, builder.build(batch.metadata)
        )


def _pad(batch, num_reqs: int, num_tokens: int) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor]:
    """The batch padded as a graph runner would: extra requests of query length 0, extra tokens slot -1."""
    md = batch.metadata
    extra_reqs, extra_tokens = num_reqs - md.num_reqs, num_tokens - md.num_actual_tokens
    qsl = torch.cat([md.query_start_loc, md.query_start_loc[-1:].repeat(extra_reqs)])
    seq_lens = torch.cat([md.seq_lens, torch.zeros(extra_reqs, dtype=torch.int32)])
    table = torch.cat([md.block_table, torch.zeros(extra_reqs, md.block_table.shape[1], dtype=torch.int32)])
    slots = torch.cat([md.slot_mapping, torch.full((extra_tokens,), -1, dtype=torch.int64)])
    padded = CommonAttentionMetadata(
        num_reqs=num_reqs, num_actual_tokens=num_tokens, num_decodes=md.num_decodes,
        num_decode_tokens=md.num_decode_tokens, query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens,
        seq_lens_cpu=seq_lens, max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, block_table=table,
        slot_mapping=slots,
    )  # fmt: skip

    def pad_rows(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.randn(extra_tokens, *x.shape[1:]).to(x.dtype)])

    return padded, pad_rows(batch.query), torch.stack([pad_rows(batch.new_keys), pad_rows(batch.new_values)])


def _error_against_reference(impl, batch, query, new_kv, md) -> float:
    """Relative error of the impl's output for the batch's real tokens (the rest is graph padding) against the
    float32 reference, over a fresh fp16 NHD cache holding the batch's context."""
    _, num_kv_heads, head_size = batch.new_keys.shape
    kv_cache = torch.zeros(
        2, batch.num_blocks, batch.block_size, num_kv_heads, head_size, dtype=torch.float16
    )
    batch.fill_cache(kv_cache[0], kv_cache[1])
    layer = types.SimpleNamespace(k_scale=torch.tensor(1.0), v_scale=torch.tensor(1.0))
    out = torch.full_like(query, float("nan"))
    impl.forward(layer, query, new_kv[0], new_kv[1], kv_cache, md, output=out)
    real = batch.metadata.num_actual_tokens
    ref = batch.reference(head_size**-0.5)
    return ((out[:real].float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize(
    "query_lens,context_lens", [([1, 1, 1], [300, 20, 77]), ([1, 1, 6, 20], [30, 5, 9, 0])]
)
def test_graph_hooks(query_lens, context_lens) -> None:
    """Capture/replay plans use the builder's fixed buffers and give exact results on padded batches."""
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 64, 16
    spec = KVCacheSpec(block_size, num_kv_heads, head_size, torch.float16, "auto")
    builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, torch.device("cpu"), 8, 64, 1024)
    impl = TritonAttentionImpl(num_heads, head_size, head_size**-0.5, num_kv_heads)
    impl.decode_config = impl.prefill_config = SMALL
    pointers = None
    for step, hook in enumerate((builder.prepare_for_capture, builder.prepare_for_replay)):
        batch = make_paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_size, block_size,
                                 dtype=torch.float16, seed=step)  # fmt: skip
        padded, query, new_kv = _pad(batch, len(query_lens) + 1, sum(query_lens) + 2)
        md = hook(padded)
        ptrs = [t.data_ptr() for t in (md.query_start_loc, md.seq_lens, md.block_table, md.slot_mapping)]
        assert pointers is None or ptrs == pointers
        pointers = ptrs
        if max(query_lens) == 1:
            assert md.num_decode_reqs == md.num_reqs and md.num_splits > 1
        else:
            assert md.num_decode_reqs == 0 and md.num_splits == 1
        assert _error_against_reference(impl, batch, query, new_kv, md) < TOLERANCE[torch.float16][0]


def test_graph_hooks_order_decodes_in_a_fixed_buffer() -> None:
    """Capture and replay sort the padded batch's lengths into the same buffer (padding, length 0, last),
    and the ordered launch matches the float32 reference on both."""
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 64, 16
    spec = KVCacheSpec(block_size, num_kv_heads, head_size, torch.float16, "auto")
    builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, torch.device("cpu"), 32, 64, 1024)
    impl = TritonAttentionImpl(num_heads, head_size, head_size**-0.5, num_kv_heads)
    query_lens, num_reqs = [1] * 20, 22
    pointer = None
    for step, hook in enumerate((builder.prepare_for_capture, builder.prepare_for_replay)):
        context_lens = RAGGED_CONTEXT_LENS[step : step + 20]
        batch = make_paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_size, block_size,
                                 dtype=torch.float16, seed=step + 7)  # fmt: skip
        padded, query, new_kv = _pad(batch, num_reqs, num_reqs)
        md = hook(padded)
        assert md.num_splits == 1 and md.num_decode_reqs == num_reqs
        assert pointer is None or md.decode_order.data_ptr() == pointer
        pointer = md.decode_order.data_ptr()
        order = md.decode_order.tolist()
        assert sorted(order[:20]) == list(range(20)) and sorted(order[20:]) == [20, 21]
        lens = [context_lens[i] + 1 for i in order[:20]]
        assert lens == sorted(lens, reverse=True)
        assert _error_against_reference(impl, batch, query, new_kv, md) < TOLERANCE[torch.float16][0]


def test_ordered_multi_token_decode_launch() -> None:
    """A speculative verification batch large enough for the ordered, unsplit decode launch (20 requests of
    up to 4 query tokens, ragged contexts, one padding request) matches the float32 reference."""
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 64, 16
    spec = KVCacheSpec(block_size, num_kv_heads, head_size, torch.float16, "auto")
    builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, torch.device("cpu"), 32, 128, 1024)
    impl = TritonAttentionImpl(num_heads, head_size, head_size**-0.5, num_kv_heads)
    query_lens = [4, 2, 4, 1, 3] * 4
    batch = make_paged_batch(query_lens, RAGGED_CONTEXT_LENS[:20], num_heads, num_kv_heads, head_size, block_size,
                             dtype=torch.float16, seed=9)  # fmt: skip
    padded, query, new_kv = _pad(batch, 21, 21 * 4)
    padded.num_decodes = padded.num_decode_tokens = 21
    padded.decode_query_len = 4
    md = builder.prepare_for_replay(padded)
    assert md.decode_query_len == 4 and md.num_splits == 1 and md.decode_order is not None
    assert _error_against_reference(impl, batch, query, new_kv, md) < TOLERANCE[torch.float16][0]


@pytest.mark.parametrize("decode_query_len,query_lens", [(4, [4, 2, 4, 1]), (8, [8, 3, 1])])
def test_graph_hooks_uniform_multi_token_decode(decode_query_len, query_lens) -> None:
    """A speculative verification batch (up to k + 1 query tokens per request, fewer where a request
    has fewer drafts, padding requests with none) takes the decode launch, split over KV segments,
    with the capture's plan, and matches the float32 reference."""
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 64, 16
    spec = KVCacheSpec(block_size, num_kv_heads, head_size, torch.float16, "auto")
    builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, torch.device("cpu"), 8, 64, 1024)
    impl = TritonAttentionImpl(num_heads, head_size, head_size**-0.5, num_kv_heads)
    impl.decode_config = SMALL
    context_lens = [300, 20, 77, 5][: len(query_lens)]
    num_reqs = len(query_lens) + 1
    for seed, hook in enumerate((builder.prepare_for_capture, builder.prepare_for_replay)):
        batch = make_paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_size, block_size,
                                 dtype=torch.float16, seed=seed + 5)  # fmt: skip
        padded, query, new_kv = _pad(batch, num_reqs, num_reqs * decode_query_len)
        padded.num_decodes = padded.num_decode_tokens = num_reqs
        padded.decode_query_len = decode_query_len
        # The capture sees the bound; a replay its batch's own longest query.
        padded.max_query_len = decode_query_len if seed == 0 else max(query_lens)
        md = hook(padded)
        assert md.num_decode_reqs == num_reqs and md.decode_query_len == decode_query_len
        assert md.num_splits > 1
        assert _error_against_reference(impl, batch, query, new_kv, md) < TOLERANCE[torch.float16][0]
    too_long = dataclasses.replace(padded, max_query_len=decode_query_len + 1)
    with pytest.raises(ValueError, match="more than decode_query_len"):
        builder.prepare_for_replay(too_long)


def test_benchmark_tiny_runs(tmp_path) -> None:
    """The kernel benchmark's CPU mode: checks against the reference, times, writes its JSON."""
    import json

    from kvllm.benchmarks.attention.main import main

    out = tmp_path / "bench.json"
    argv = ["--tiny", "--only-shapes", "--shape", "t:2x1@20+1x8@4", "--peers", "triton,sdpa,fa4",
            "--dtype", "float16", "--output-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kernel"], r["status"]) for r in rows][:1] == [("TRITON_ATTN", "ok")]
    assert rows[-1]["status"] == "skipped"


def test_hnd_pages_keep_the_shape_and_store_each_head_contiguously(monkeypatch) -> None:
    monkeypatch.setenv("KVLLM_TRITON_KV_LAYOUT", "HND")
    cache = TritonAttentionBackend.allocate_kv_cache(5, 16, 4, 64, torch.float16, "cpu")
    assert cache.shape == (2, 5, 16, 4, 64)
    assert cache.stride() == (5 * 4 * 16 * 64, 4 * 16 * 64, 64, 16 * 64, 1)  # block, head, token, dim
    assert not cache.any()
    case = run_triton_case(
        MIXED_QUERY_LENS,
        MIXED_CONTEXT_LENS,
        4,
        2,
        64,
        16,
        torch.float16,
        decode_config=SMALL,
        prefill_config=SMALL,
    )
    assert case.kv_cache.stride(3) > case.kv_cache.stride(2)
    check(case, torch.float16)
    monkeypatch.setenv("KVLLM_TRITON_KV_LAYOUT", "NDH")
    with pytest.raises(ValueError, match="KVLLM_TRITON_KV_LAYOUT='NDH'"):
        TritonAttentionBackend.allocate_kv_cache(5, 16, 4, 64, torch.float16, "cpu")


def test_split_policy_switch(monkeypatch) -> None:
    spec = KVCacheSpec(16, 8, 128, torch.float16, "auto")
    monkeypatch.setenv("KVLLM_TRITON_SPLIT_POLICY", "8,12")
    builder = TritonAttentionMetadataBuilder(
        TritonAttentionBackend, spec, torch.device("cpu"), 256, 8192, 4096
    )
    builder.num_sms = 132
    assert builder.num_splits_for(64, 4096) == 4  # 512 programs < 8 x 132: split towards 12 x 132
    assert builder.num_splits_for(256, 4096) == 1
    monkeypatch.setenv("KVLLM_TRITON_SPLIT_POLICY", "8")
    with pytest.raises(ValueError, match="KVLLM_TRITON_SPLIT_POLICY='8'"):
        TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, torch.device("cpu"), 256, 8192, 4096)


def test_decode_plan_setting(monkeypatch) -> None:
    spec = KVCacheSpec(16, 8, 128, torch.float16, "auto")

    def builder():
        return TritonAttentionMetadataBuilder(
            TritonAttentionBackend, spec, torch.device("cpu"), 256, 8192, 4096
        )

    monkeypatch.setenv("KVLLM_TRITON_DECODE_PLAN", "128:64,2,3,2,o; 48:32,4,4,4")
    b = builder()
    b.num_sms = 132
    assert [e.max_reqs for e in b.decode_plan] == [48, 128]  # sorted, whatever the order written
    assert b.plan_for(33, graph=True).tile_n == 32 and b.plan_for(48, graph=True).num_stages == 4
    assert b.plan_for(49, graph=True).num_stages == 3 and b.plan_for(128, graph=True).ordered
    assert b.plan_for(129, graph=True) is None and b.plan_for(0, graph=True) is None
    assert b.plan_for(40, graph=False) is None  # eager launches keep the defaults
    assert b.num_splits_for(40, 4096, graph=True) == 4 and b.num_splits_for(100, 4096, graph=True) == 2
    assert b.num_splits_for(40, 300, graph=True) == 1  # never a segment below MIN_SPLIT_TOKENS
    assert b.num_splits_for(256, 4096, graph=True) == 1  # past the plan: the default policy
    assert b.num_splits_for(100, 4096) == 1  # eager: the default policy
    assert b.orders_decodes(100, 2, graph=True) and not b.orders_decodes(40, 4, graph=True)
    monkeypatch.setenv("KVLLM_TRITON_DECODE_ORDER", "batch")
    assert not builder().orders_decodes(100, 2, graph=True)
    for bad in ("64:64,2,2", "x:64,2,2,1", "64:48,2,2,1", "64:64,2,2,3", "64:64,2,2,128", "64:64,0,2,1"):
        monkeypatch.setenv("KVLLM_TRITON_DECODE_PLAN", bad)
        with pytest.raises(ValueError, match="KVLLM_TRITON_DECODE_PLAN entry"):
            builder()


@pytest.mark.parametrize("plan", ["32:16,4,1,4,o", "32:16,2,2,2", "32:32,4,3,1"])
def test_planned_decode_launch(monkeypatch, plan) -> None:
    """A graph launch takes the plan's split count, order and tiles (ordered split launches included) and
    still matches the float32 reference on a padded batch; an eager build of the same batch ignores the plan."""
    monkeypatch.setenv("KVLLM_TRITON_DECODE_PLAN", plan)
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 64, 16
    spec = KVCacheSpec(block_size, num_kv_heads, head_size, torch.float16, "auto")
    builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, torch.device("cpu"), 32, 64, 1200)
    impl = TritonAttentionImpl(num_heads, head_size, head_size**-0.5, num_kv_heads)
    contexts = [1100] + RAGGED_CONTEXT_LENS[1:20]  # long enough for 4 segments of MIN_SPLIT_TOKENS
    batch = make_paged_batch([1] * 20, contexts, num_heads, num_kv_heads, head_size, block_size,
                             dtype=torch.float16, seed=5)  # fmt: skip
    padded, query, new_kv = _pad(batch, 22, 22)
    md = builder.prepare_for_replay(padded)
    tile_n, warps, stages, splits = (int(x) for x in plan.split(":")[1].split(",")[:4])
    assert md.decode_plan is not None and md.num_decode_reqs == 22 and md.num_splits == splits
    assert (md.decode_order is not None) == (plan.endswith(",o") or splits == 1)
    cfg = impl._planned_config(md, torch.float16)
    assert (cfg.tile_n, cfg.num_warps, cfg.num_stages) == (tile_n, warps, stages)
    assert _error_against_reference(impl, batch, query, new_kv, md) < TOLERANCE[torch.float16][0]
    eager = builder.build(batch.metadata)
    assert eager.decode_plan is None and eager.num_splits == builder.num_splits_for(20, 1101)


def test_reads_written_kv_only_when_the_prefill_kernel_is_forced(monkeypatch) -> None:
    """The unified kernel reads a stored step's K/V from the cache; the prefill kernel reads them from its
    inputs (new_kv). The piecewise runner copies them for it only where it is forced (switch at 1, or a
    PrefillConfig): by default (auto) the few steps that take it gather their K/V back themselves."""
    from kvllm.attention.ops.triton_prefill_config import prefill_kernel_config

    monkeypatch.delenv("KVLLM_TRITON_PREFILL_KERNEL", raising=False)
    impl = TritonAttentionImpl(4, 64, 0.125, 2)
    assert not impl.reads_written_kv()
    impl.prefill_config = prefill_kernel_config(64, 2, torch.float16, 16)
    assert impl.reads_written_kv()
    for switch, forced in (("1", True), ("0", False), ("auto", False)):
        monkeypatch.setenv("KVLLM_TRITON_PREFILL_KERNEL", switch)
        assert TritonAttentionImpl(4, 64, 0.125, 2).reads_written_kv() == forced


@pytest.mark.parametrize(("query_lens", "takes_prefill_kernel"), [([1, 30, 40], True), ([1, 10, 12], False)])
def test_auto_route_reads_the_step_kv_back_when_the_runner_left_it_unstaged(
    monkeypatch, query_lens, takes_prefill_kernel
) -> None:
    """Default (auto) routing, the layer having stored its K/V (kv_written) and the key/value arguments
    holding garbage, as the piecewise runner leaves them when it does not copy: a batch of long chunks takes
    the prefill kernel on K/V read back from the cache, shorter ones the unified kernel, and both match the
    float32 reference."""
    from kvllm.attention.backends import triton_attn_impl
    from kvllm.attention.ops import triton_prefill_attention as prefill_ops
    from kvllm.attention.ops import triton_prefill_config
    from kvllm.attention.ops import triton_unified_attention as unified_ops
    from kvllm.attention.ops.triton_prefill_config import PrefillConfig
    from kvllm.attention.ops.triton_reshape_and_cache import reshape_and_cache

    monkeypatch.delenv("KVLLM_TRITON_PREFILL_KERNEL", raising=False)
    monkeypatch.setattr(triton_prefill_config, "AUTO_MIN_MEAN_QUERY_LEN", 24)  # small, for the interpreter
    small = PrefillConfig(32, 16, 4, 1, new_kv=True)  # small tiles: fast in the interpreter
    monkeypatch.setattr(triton_attn_impl, "prefill_kernel_config", lambda *a: small)
    launches = []
    real = prefill_ops.prefill_attention
    monkeypatch.setattr(unified_ops, "prefill_attention", lambda *a, **k: launches.append(k) or real(*a, **k))
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 64, 16
    spec = KVCacheSpec(block_size, num_kv_heads, head_size, torch.float16, "auto")
    builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, torch.device("cpu"), 8, 128, 256)
    impl = TritonAttentionImpl(num_heads, head_size, head_size**-0.5, num_kv_heads)
    batch = make_paged_batch(query_lens, [7, 20, 0], num_heads, num_kv_heads, head_size, block_size,
                             dtype=torch.float16, seed=11)  # fmt: skip
    md = builder.build(batch.metadata)
    kv_cache = torch.zeros(2, batch.num_blocks, block_size, num_kv_heads, head_size, dtype=torch.float16)
    batch.fill_cache(kv_cache[0], kv_cache[1])
    one = torch.tensor(1.0)
    reshape_and_cache(batch.new_keys, batch.new_values, kv_cache[0], kv_cache[1], md.slot_mapping, one, one)
    garbage = torch.full_like(batch.new_keys, float("nan"))
    layer = types.SimpleNamespace(k_scale=one, v_scale=one)
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(layer, batch.query, garbage, garbage.clone(), kv_cache, md, output=out, kv_written=True)
    ref = batch.reference(head_size**-0.5)
    assert ((out.float() - ref).norm() / ref.norm()).item() < TOLERANCE[torch.float16][0]
    assert [k["cfg"] for k in launches] == ([small] if takes_prefill_kernel else [])
    if takes_prefill_kernel:
        assert torch.equal(launches[0]["key"], batch.new_keys)  # read back from the cache, token by token
