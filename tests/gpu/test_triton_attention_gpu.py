"""TRITON_ATTN kernels on a CUDA GPU in bf16 and fp16, against the float32 reference.

Run on the H200: `PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_triton_attention_gpu.py`
(the fp8 part alone, about a dozen kernel compilations: add `-k "fp8 or kv_write"`).

Tolerances (relative L2 error of the output / max abs error; values are O(1)). The reference attends
in float32 over exactly the K/V the cache holds (read back from it, fp8 dequantized with the scales), so
the kernel differs from it only by summation order (float32, negligible) and two roundings to the model
dtype with unit roundoff u (fp16 2^-11 = 4.9e-4, bf16 8 bits of mantissa: 2^-8 = 3.9e-3): P before the
P.V dot (the row sum l stays float32, so these errors do not cancel) and the output. Each is a relative
error of RMS about u / sqrt(3), independent per element, so the relative L2 error is about
sqrt(2/3) u: fp16 4e-4, bf16 3.2e-3 (a torch emulation of these two roundings on this file's batch
gives 2.6e-4 / 2.0e-3, with or without fp8 caches, max abs 1e-3 / 8e-3). Tolerances are about 5x the
RMS bound: fp16 2e-3 / 1e-2, bf16 1e-2 / 6e-2, the same for fp8 caches, which add no error of their own.
"""

from __future__ import annotations

import types

import pytest
import torch

from kvllm.attention.backends.triton_attn import TritonAttentionBackend
from kvllm.attention.metadata import CommonAttentionMetadata, KVCacheSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOLERANCE = {torch.float16: (2e-3, 1e-2), torch.bfloat16: (1e-2, 6e-2)}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
# Decodes (short and long contexts) first, then prefill chunks over cached prefixes and from scratch.
QUERY_LENS = [1, 1, 1, 1, 17, 200, 513]
CONTEXT_LENS = [1, 700, 2048, 63, 300, 0, 1500]


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


@DTYPES
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (16, 8), (16, 4), (32, 4), (28, 4)])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_mixed_batch(dtype, num_heads, num_kv_heads, head_size) -> None:
    check(run(QUERY_LENS, CONTEXT_LENS, num_heads, num_kv_heads, head_size, 16, dtype), dtype)


@DTYPES
@pytest.mark.parametrize("block_size", [32, 64, 128])
@pytest.mark.parametrize("head_size", [32, 128])
def test_block_sizes(dtype, block_size, head_size) -> None:
    check(run(QUERY_LENS, CONTEXT_LENS, 16, 8, head_size, block_size, dtype), dtype)


@DTYPES
@pytest.mark.parametrize(
    "sliding_window,logits_soft_cap,use_sinks",
    [(128, None, False), (None, 30.0, False), (None, None, True), (1024, 50.0, True), (1, None, True)],
    ids=["window", "softcap", "sinks", "all", "window1-sinks"],
)
def test_features(dtype, sliding_window, logits_soft_cap, use_sinks) -> None:
    case = run(QUERY_LENS, CONTEXT_LENS, 32, 4, 128, 16, dtype, sliding_window=sliding_window,
               logits_soft_cap=logits_soft_cap, use_sinks=use_sinks)  # fmt: skip
    check(case, dtype)


# Each dtype with each fp8 format, head sizes alternating: four cases keep `-k fp8` quick to compile;
# the head-size and GQA sweep runs in the model-dtype tests above (the kernel's fp8 path only adds
# the upcast of K/V tiles and the two scales).
@pytest.mark.parametrize(
    "dtype,kv_cache_dtype,head_size",
    [
        (torch.bfloat16, "fp8_e4m3", 128),
        (torch.bfloat16, "fp8_e5m2", 80),
        (torch.float16, "fp8_e4m3", 80),
        (torch.float16, "fp8_e5m2", 128),
    ],
    ids=["bf16-e4m3-d128", "bf16-e5m2-d80", "fp16-e4m3-d80", "fp16-e5m2-d128"],
)
@pytest.mark.parametrize("dot", ["fp16", "bf16", "fp16_registers"])
def test_fp8_kv_cache(dtype, kv_cache_dtype, head_size, dot, monkeypatch) -> None:
    """Both dot dtypes of an fp8 cache (KVLLM_FP8_ATTENTION_DOT); fp16 queries run fp16 dots in both."""
    monkeypatch.setenv("KVLLM_FP8_ATTENTION_DOT", dot)
    case = run(QUERY_LENS, CONTEXT_LENS, 16, 8, head_size, 16, dtype, kv_cache_dtype=kv_cache_dtype,
               k_scale=0.37, v_scale=1.7, use_sinks=True)  # fmt: skip
    check(case, dtype)


@DTYPES
@pytest.mark.parametrize("num_splits", [None, 4, 64])
@pytest.mark.parametrize("sliding_window,use_sinks", [(None, False), (500, True)])
def test_split_kv_decode(dtype, num_splits, sliding_window, use_sinks) -> None:
    # None: the builder's own choice (it splits batch 2 x 16k on any GPU with >= 2 SMs).
    case = run([1, 1], [16384, 100], 16, 8, 128, 16, dtype, num_splits=num_splits,
               sliding_window=sliding_window, use_sinks=use_sinks)  # fmt: skip
    check(case, dtype)


@DTYPES
@pytest.mark.parametrize("num_splits", [1, 8])
@pytest.mark.parametrize("decode_query_len", [4, 8])
def test_multi_token_decode_launch(dtype, num_splits, decode_query_len) -> None:
    """A speculative verification batch in the decode launch: up to k + 1 query tokens per request
    (fewer for some), each program all of its request's rows, split-KV reduced per token."""
    from kvllm.attention.testing import run_backend_case

    query_lens = [decode_query_len, 1, decode_query_len - 1, decode_query_len]
    attrs = {"num_decode_reqs": 4, "decode_query_len": decode_query_len, "num_splits": num_splits}
    case = run_backend_case(
        TritonAttentionBackend, query_lens, [3000, 17, 700, 64], 16, 8, 128, 16, dtype, "cuda",
        reference="cache", preallocated_output=True, metadata_attrs=attrs,
    )  # fmt: skip
    check(case, dtype)


@DTYPES
def test_large_decode_batch(dtype) -> None:
    check(run([1] * 256, [1024] * 256, 16, 8, 128, 16, dtype), dtype)


@DTYPES
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_ragged_decode_batch_longest_first(dtype, layout, monkeypatch) -> None:
    """256 decodes of ragged contexts in draw order (an ordered, unsplit launch) and a prefill behind them,
    with the cache's pages token-major and head-major in memory."""
    import random

    monkeypatch.setenv("KVLLM_TRITON_KV_LAYOUT", layout)
    draw = random.Random(5)
    contexts = [draw.randint(1, 2047) for _ in range(256)] + [300]
    case = run([1] * 256 + [40], contexts, 16, 8, 128, 16, dtype)
    assert case.metadata.decode_order is not None and case.metadata.num_splits == 1
    assert (case.kv_cache.stride(3) > case.kv_cache.stride(2)) == (layout == "HND")
    check(case, dtype)


@DTYPES
def test_prefill_long(dtype) -> None:
    check(run([2048, 2048], [0, 0], 16, 8, 128, 16, dtype), dtype)


@pytest.mark.parametrize("uniform_decode", [True, False], ids=["decode", "mixed"])
def test_cuda_graph_capture_and_replay(uniform_decode) -> None:
    """Capture the KV write + attention once, replay it on a fresh batch of the same padded size."""
    from kvllm.attention.backends.triton_attn_impl import TritonAttentionImpl, TritonAttentionMetadataBuilder
    from kvllm.attention.reference import make_paged_batch

    heads, kv_heads, head_size, block_size, dtype = 16, 8, 128, 16, torch.bfloat16
    query_lens = [1] * 6 if uniform_decode else [1, 1, 40, 7]
    pad_reqs, pad_tokens = 8, sum(query_lens) + (2 if uniform_decode else 5)
    if uniform_decode:
        pad_tokens = pad_reqs  # a decode graph has one token per (possibly padded) request
    spec = KVCacheSpec(block_size, kv_heads, head_size, dtype, "auto")
    builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, torch.device("cuda"), 8, 256, 8192)
    impl = TritonAttentionImpl(heads, head_size, head_size**-0.5, kv_heads)
    layer = types.SimpleNamespace(
        k_scale=torch.tensor(1.0, device="cuda"), v_scale=torch.tensor(1.0, device="cuda")
    )
    num_blocks = 8 * 8192 // block_size
    kv_cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_size, dtype=dtype, device="cuda")
    query = torch.zeros(pad_tokens, heads, head_size, dtype=dtype, device="cuda")
    new_kv = torch.zeros(2, pad_tokens, kv_heads, head_size, dtype=dtype, device="cuda")
    out = torch.zeros_like(query)

    def batch_and_metadata(seed: int, hook):
        ctx = [
            int(c)
            for c in torch.randint(1, 3000, (len(query_lens),), generator=torch.Generator().manual_seed(seed))
        ]
        used = sum(-(-(q + c) // block_size) for q, c in zip(query_lens, ctx))
        batch = make_paged_batch(query_lens, ctx, heads, kv_heads, head_size, block_size, dtype=dtype,
                                 device="cuda", seed=seed, extra_blocks=num_blocks - used)  # fmt: skip
        md = batch.metadata
        extra_reqs, extra_tokens = pad_reqs - md.num_reqs, pad_tokens - md.num_actual_tokens
        qsl = torch.cat([md.query_start_loc, md.query_start_loc[-1:].repeat(extra_reqs)])
        seq_lens = torch.cat([md.seq_lens, torch.zeros(extra_reqs, dtype=torch.int32, device="cuda")])
        table = torch.cat([md.block_table, torch.zeros(extra_reqs, md.block_table.shape[1], dtype=torch.int32,
                                                       device="cuda")])  # fmt: skip
        slots = torch.cat(
            [md.slot_mapping, torch.full((extra_tokens,), -1, dtype=torch.int64, device="cuda")]
        )
        padded = CommonAttentionMetadata(
            num_reqs=pad_reqs, num_actual_tokens=pad_tokens, num_decodes=md.num_decodes,
            num_decode_tokens=md.num_decode_tokens, query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(),
            seq_lens=seq_lens, seq_lens_cpu=seq_lens.cpu(), max_query_len=md.max_query_len,
            max_seq_len=md.max_seq_len, block_table=table, slot_mapping=slots,
        )  # fmt: skip
        kv_cache.zero_()
        batch.fill_cache(kv_cache[0], kv_cache[1])
        query[: md.num_actual_tokens] = batch.query
        new_kv[0, : md.num_actual_tokens] = batch.new_keys
        new_kv[1, : md.num_actual_tokens] = batch.new_values
        return batch, hook(padded)

    _, md = batch_and_metadata(0, builder.prepare_for_capture)
    impl.forward(layer, query, new_kv[0], new_kv[1], kv_cache, md, output=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(layer, query, new_kv[0], new_kv[1], kv_cache, md, output=out)
    for seed in (1, 2):
        batch, _ = batch_and_metadata(seed, builder.prepare_for_replay)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        real = batch.metadata.num_actual_tokens
        ref = batch.reference(head_size**-0.5)
        err = ((out[:real].float() - ref).norm() / ref.norm()).item()
        assert err < TOLERANCE[dtype][0], f"replay {seed}: relative error {err:.2e}"


@pytest.mark.parametrize(
    "cache_dtype",
    [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2],
    ids=["bf16", "fp8_e4m3", "fp8_e5m2"],
)
def test_kv_write_gpu(cache_dtype) -> None:
    """The compiled KV write is bit-exact: fp8 stores the IEEE quotient x / scale rounded to nearest even."""
    from kvllm.attention.ops.triton_reshape_and_cache import reshape_and_cache
    from kvllm.attention.testing import fp8_quantize

    gen = torch.Generator().manual_seed(0)
    key = (torch.randn(1000, 8, 128, generator=gen) * 3).to(torch.bfloat16).cuda()
    # Magnitudes 2^-18 .. 2^4: fp8 subnormals of both formats up to well inside the range (no overflow).
    magnitude = torch.exp2(torch.randint(-18, 5, (1000, 8, 1), generator=gen).float())
    value = (torch.randn(1000, 8, 128, generator=gen) * magnitude).to(torch.bfloat16).cuda()
    slots = torch.randperm(4096, generator=gen)[:1000].cuda()
    slots[::7] = -1
    key_cache = torch.zeros(256, 16, 8, 128, device="cuda").to(cache_dtype)
    value_cache = torch.zeros_like(key_cache)
    scale = 0.37 if cache_dtype != torch.bfloat16 else 1.0
    reshape_and_cache(key, value, key_cache, value_cache, slots, torch.tensor(scale, device="cuda"),
                      torch.tensor(scale, device="cuda"))  # fmt: skip
    keep = slots >= 0
    flat_k, flat_v = key_cache.view(4096, 8, 128), value_cache.view(4096, 8, 128)
    if cache_dtype == torch.bfloat16:
        want_k, want_v = key[keep], value[keep]
    else:  # on the CPU: IEEE division there whatever the divisor's type (see fp8_quantize)
        want_k = fp8_quantize(key[keep].cpu(), cache_dtype, scale).cuda()
        want_v = fp8_quantize(value[keep].cpu(), cache_dtype, scale).cuda()
    for name, got, want in (("key", flat_k[slots[keep]], want_k), ("value", flat_v[slots[keep]], want_v)):
        diff = got.view(torch.uint8) != want.view(torch.uint8)
        assert not diff.any(), (
            f"{name}: {int(diff.sum())} elements differ, e.g. stored {got[diff][:4].float().tolist()} "
            f"for torch's {want[diff][:4].float().tolist()}"
        )
    written = torch.zeros(4096, dtype=torch.bool, device="cuda")
    written[slots[keep]] = True
    assert not flat_k[~written].float().any()
