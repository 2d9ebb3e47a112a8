"""FLEX_ATTENTION on a GPU (compiled Triton FlexAttention) against the float32 reference.

Walks what FlexAttentionBackend declares for CUDA: every head-size class in bfloat16 (the
issue's target dtype; 16 is the smallest the compiled kernel takes), float16 and float32 at head size 128, block sizes 16/32/64 crossed
with the features (plain, sliding window, soft-cap, non-causal), encoder-only, GQA 1/2/4, a
float16 cache under a bfloat16 model, and the compile bound over a short generation. Mixed
batches: decodes first, a fresh prompt and chunked prefills, scrambled block tables. Cache
slots no request owns hold large finite garbage, so reading past a sequence shows up.
Compile-failure state is reset before every test, so one configuration's failure cannot fail
the tests after it.
The split path (CUDA's default) is set explicitly for every test here (KVLLM_FLEX_SPLIT_PATH=1), so
decode-only and fresh-prefill steps take it; the general path is checked on those steps too.
Run on the H200: `pytest -m gpu tests/gpu/test_flex_attention_gpu.py`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvllm.attention.backend import AttentionSelectorConfig
from kvllm.attention.backends import flex_attention_impl as flex
from kvllm.attention.backends.flex_attention import FlexAttentionBackend as Backend
from kvllm.attention.backends.flex_attention_decode import decode_bucket
from kvllm.attention.backends.flex_attention_prefill import padded_length
from kvllm.attention.metadata import KVCacheSpec
from kvllm.attention.reference import PagedBatch, make_paged_batch
from kvllm.attention.testing import make_builder, make_impl
from kvllm.platforms.interface import DeviceInfo

# KVLLM_GPU_TEST_DEVICE=cpu dry-runs the harness on the CPU kernel (not a GPU check).
DEVICE = torch.device(os.environ.get("KVLLM_GPU_TEST_DEVICE", "cuda"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-3}  # max |err| / max |ref|
QUERY_LENS = [1, 1, 1, 1, 37, 5, 70]
CONTEXT_LENS = [0, 31, 80, 130, 0, 57, 19]
MAX_NUM_REQS, MAX_MODEL_LEN = 16, 512
WINDOW, SOFT_CAP = 24, 5.0


@pytest.fixture(autouse=True)
def compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compile requested, the split path (decoding kernel, fresh prefills) on, and no compile
    failure (nor one-time log) left over from earlier tests."""
    monkeypatch.setenv(flex.COMPILE_ENV, "1")
    monkeypatch.setenv(flex.SPLIT_PATH_ENV, "1")
    monkeypatch.setattr(flex, "_compile_failures", {})
    monkeypatch.setattr(flex, "_decode_failures", {})
    monkeypatch.setattr(flex, "_announced", set())


def device_info() -> DeviceInfo:
    if DEVICE.type != "cuda":
        return DeviceInfo("cpu")
    platform = "rocm" if torch.version.hip else "cuda"
    return DeviceInfo(platform, torch.cuda.get_device_capability(DEVICE))


def run(batch: PagedBatch, num_heads: int, num_kv_heads: int, head_size: int, cache_dtype: torch.dtype,
        **options: Any) -> torch.Tensor:  # fmt: skip
    out = prepare(batch, num_heads, num_kv_heads, head_size, cache_dtype, **options)()
    assert not flex.compile_failures(), flex.compile_failures()
    return out


def prepare(
    batch: PagedBatch,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    cache_dtype: torch.dtype,
    *,
    window: int | None = None,
    soft_cap: float | None = None,
    causal: bool = True,
    attn_type: str = "decoder",
    kv_cache_dtype: str = "auto",
) -> Callable[[], torch.Tensor]:
    """One step of `batch` as the engine runs it: the metadata build, then the layer's forward."""
    builder = make_builder(Backend, batch, cache_dtype, kv_cache_dtype, (MAX_NUM_REQS, 2048, MAX_MODEL_LEN))
    impl = make_impl(Backend, num_heads, head_size, num_kv_heads, sliding_window=window, logits_soft_cap=soft_cap,
                     attn_type=attn_type, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    batch.metadata.causal = causal
    if attn_type == "encoder_only":
        kv_cache = torch.empty(0, device=DEVICE)
    else:
        shape = Backend.get_kv_cache_shape(batch.num_blocks, batch.block_size, num_kv_heads, head_size)
        kv_cache = (torch.randn(shape, device=DEVICE) * 100).to(cache_dtype)
        batch.fill_cache(kv_cache[0], kv_cache[1])
    return lambda: impl.forward(
        None, batch.query, batch.new_keys, batch.new_values, kv_cache, builder.build(batch.metadata)
    )


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


def validate(head_size: int, dtype: torch.dtype, block_size: int | None, **features: object) -> None:
    config = AttentionSelectorConfig(
        head_size=head_size, dtype=str(dtype).removeprefix("torch."), block_size=block_size, **features
    )
    assert Backend.validate_configuration(config, device_info()) == []


@pytest.mark.parametrize("head_size", [16, 40, 64, 72, 128, 256])
def test_head_sizes_bf16(head_size: int) -> None:
    validate(head_size, torch.bfloat16, 16)
    batch = make_paged_batch(QUERY_LENS, CONTEXT_LENS, 8, 4, head_size, 16, torch.bfloat16, DEVICE, seed=1)
    out = run(batch, 8, 4, head_size, torch.bfloat16)
    check(out, batch.reference(head_size**-0.5), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_kv_heads", [8, 2])  # GQA 1 and 4
def test_dtypes(dtype: torch.dtype, num_kv_heads: int) -> None:
    validate(128, dtype, 16)
    batch = make_paged_batch(QUERY_LENS, CONTEXT_LENS, 8, num_kv_heads, 128, 16, dtype, DEVICE, seed=2)
    check(run(batch, 8, num_kv_heads, 128, dtype), batch.reference(128**-0.5), dtype)


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("feature", ["plain", "window", "soft_cap", "non_causal"])
def test_block_sizes_and_features(block_size: int, feature: str) -> None:
    window = WINDOW if feature == "window" else None
    soft_cap = SOFT_CAP if feature == "soft_cap" else None
    causal = feature != "non_causal"
    validate(
        128,
        torch.bfloat16,
        block_size,
        has_sliding_window=window is not None,
        logits_soft_cap=soft_cap,
        use_non_causal=not causal,
    )
    batch = make_paged_batch(QUERY_LENS, CONTEXT_LENS, 16, 8, 128, block_size, torch.bfloat16, DEVICE, seed=3)
    out = run(batch, 16, 8, 128, torch.bfloat16, window=window, soft_cap=soft_cap, causal=causal)
    ref = batch.reference(128**-0.5, causal=causal, sliding_window=window, logits_soft_cap=soft_cap)
    check(out, ref, torch.bfloat16)


@pytest.mark.parametrize(
    ("block_size", "feature", "num_kv_heads"),
    [(16, "plain", 8), (16, "plain", 2), (16, "window", 8), (16, "soft_cap", 8), (32, "window", 2),
     (64, "plain", 8), (64, "window", 8)],
)  # fmt: skip
def test_decode_only_steps_take_the_decoding_kernel(block_size: int, feature: str, num_kv_heads: int) -> None:
    """Decode-only batches (full pages, partial last pages, window edges, a context-0 decode)."""
    window = WINDOW if feature == "window" else None
    soft_cap = SOFT_CAP if feature == "soft_cap" else None
    contexts = [0, 15, 31, 80, 130, 255, 7, 64, 300]
    batch = make_paged_batch([1] * len(contexts), contexts, 16, num_kv_heads, 128, block_size, torch.bfloat16,
                             DEVICE, seed=7)  # fmt: skip
    out = run(batch, 16, num_kv_heads, 128, torch.bfloat16, window=window, soft_cap=soft_cap)
    check(out, batch.reference(128**-0.5, sliding_window=window, logits_soft_cap=soft_cap), torch.bfloat16)


@pytest.mark.parametrize(
    ("block_size", "feature", "num_kv_heads"),
    [(16, "plain", 8), (16, "window", 2), (16, "soft_cap", 8), (64, "plain", 2)],
)
def test_fresh_prefills_beside_decodes(block_size: int, feature: str, num_kv_heads: int) -> None:
    """Decodes first, then prompts with nothing cached: the decoding kernel and the packed
    fresh-prefill kernel over the step's own K/V (tiles crossing prompt boundaries included)."""
    window = 100 if feature == "window" else None
    soft_cap = SOFT_CAP if feature == "soft_cap" else None
    query_lens, context_lens = [1] * 5 + [37, 300, 129], [0, 15, 80, 130, 255, 0, 0, 0]
    batch = make_paged_batch(query_lens, context_lens, 16, num_kv_heads, 128, block_size, torch.bfloat16, DEVICE,
                             seed=8)  # fmt: skip
    out = run(batch, 16, num_kv_heads, 128, torch.bfloat16, window=window, soft_cap=soft_cap)
    check(out, batch.reference(128**-0.5, sliding_window=window, logits_soft_cap=soft_cap), torch.bfloat16)


@pytest.mark.parametrize("query_lens", [[512, 256, 256], [300, 37, 129]], ids=["fills_1024", "padded"])
@pytest.mark.parametrize("feature", ["plain", "window"])
def test_a_step_of_fresh_prefills(query_lens: list[int], feature: str) -> None:
    """Prompts only, nothing cached: the compiled kernel's output is the step's (no zeroed copy); q, k and
    v go in as the step's strided views when they fill the packed length (1,024), else padded."""
    window = 100 if feature == "window" else None
    batch = make_paged_batch(
        query_lens, [0] * len(query_lens), 16, 8, 128, 16, torch.bfloat16, DEVICE, seed=9
    )
    qkv = torch.cat([batch.query.flatten(1), batch.new_keys.flatten(1), batch.new_values.flatten(1)], dim=1)
    q, k, v = qkv.split([16 * 128, 8 * 128, 8 * 128], dim=1)  # views of a fused qkv, as the model passes them
    batch.query, batch.new_keys, batch.new_values = (t.view(-1, h, 128) for t, h in ((q, 16), (k, 8), (v, 8)))
    out = run(batch, 16, 8, 128, torch.bfloat16, window=window)
    check(out, batch.reference(128**-0.5, sliding_window=window), torch.bfloat16)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the sync debug mode is CUDA's")
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [([1] * 6, [0, 15, 80, 130, 255, 300]), ([1, 1, 37, 300], [15, 80, 0, 0]), (QUERY_LENS, CONTEXT_LENS)],
    ids=["decodes", "fresh_prefills_beside_decodes", "general"],
)
def test_a_step_never_waits_for_the_device(query_lens: list[int], context_lens: list[int]) -> None:
    """The metadata build and the forward (block masks, the K/V write, the kernels) only enqueue work,
    so the host can prepare the next layer and step while the GPU runs (issue 23): torch's sync debug
    mode raises on any synchronizing call in a step after the first (which compiles)."""
    batch = make_paged_batch(query_lens, context_lens, 16, 8, 128, 16, torch.bfloat16, DEVICE, seed=12)
    step = prepare(batch, 16, 8, 128, torch.bfloat16)
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not flex.compile_failures(), flex.compile_failures()
    check(out, batch.reference(128**-0.5), torch.bfloat16)


@pytest.mark.parametrize("window", [None, 8])
def test_encoder_only(window: int | None) -> None:
    validate(64, torch.bfloat16, None, attn_type="encoder_only", use_non_causal=True)
    query_lens = [5, 40, 9, 1, 70]
    batch = make_paged_batch(query_lens, [0] * 5, 8, 4, 64, 16, torch.bfloat16, DEVICE, seed=4)
    out = run(batch, 8, 4, 64, torch.bfloat16, window=window, causal=False, attn_type="encoder_only")
    check(out, batch.reference(64**-0.5, causal=False, sliding_window=window), torch.bfloat16)


def test_float16_cache_under_bfloat16_model() -> None:
    batch = make_paged_batch(QUERY_LENS, CONTEXT_LENS, 8, 4, 64, 16, torch.bfloat16, DEVICE, seed=5)
    out = run(batch, 8, 4, 64, torch.float16, kv_cache_dtype="float16")
    assert out.dtype == torch.bfloat16
    check(out, batch.reference(64**-0.5), torch.bfloat16)


def test_compile_count_over_decode_steps() -> None:
    """40 steps, 1..24 decodes and a prefill every 10 steps, over one fixed-size cache: only the
    padded query length (mixed steps) or padded batch (decode-only steps) varies, so at most one graph
    per power-of-two bucket is compiled.
    """
    num_blocks, block_size, head_size = 512, 16, 64
    spec = KVCacheSpec(block_size, 4, head_size, torch.bfloat16, "auto")
    builder = Backend.get_builder_cls()(Backend, spec, DEVICE, 32, 2048, MAX_MODEL_LEN)
    impl = Backend.get_impl_cls()(8, head_size, head_size**-0.5, 4, sliding_window=WINDOW)
    shape = Backend.get_kv_cache_shape(num_blocks, block_size, 4, head_size)
    kv_cache = torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
    gen = torch.Generator().manual_seed(6)
    before, buckets = flex.flex_compile_count(), set()
    for step in range(40):
        num_decodes = int(torch.randint(1, 25, (), generator=gen))
        query_lens = [1] * num_decodes + (
            [int(torch.randint(2, 60, (), generator=gen))] if step % 10 == 0 else []
        )
        context_lens = torch.randint(0, 300, (len(query_lens),), generator=gen).tolist()
        # The batch's blocks are ids < batch.num_blocks <= num_blocks: a sub-range of the fixed cache.
        batch = make_paged_batch(
            query_lens, context_lens, 8, 4, head_size, block_size, torch.bfloat16, DEVICE, seed=step
        )
        assert batch.num_blocks <= num_blocks
        batch.fill_cache(kv_cache[0], kv_cache[1])
        out = impl.forward(
            None, batch.query, batch.new_keys, batch.new_values, kv_cache, builder.build(batch.metadata)
        )
        # Split steps (decodes, then fresh prefills only) compile once per padded decode batch and
        # per padded prefill length; the others once per padded query length.
        if all(c == 0 for c in context_lens[num_decodes:]):
            buckets.add(("decode", decode_bucket(num_decodes)))
            if len(query_lens) > num_decodes:
                buckets.add(("fresh", padded_length(sum(query_lens[num_decodes:]))))
        else:
            buckets.add(flex.query_bucket(sum(query_lens)))
        if step % 5 == 0:
            check(out, batch.reference(head_size**-0.5, sliding_window=WINDOW), torch.bfloat16)
    assert not flex.compile_failures(), flex.compile_failures()
    assert flex.flex_compile_count() - before <= len(buckets), buckets


@pytest.mark.parametrize("split_path", ["0", "1"])
def test_decode_steps_many_pages_either_path(split_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode-only batch of long sequences (tens of full pages each, over more KV splits than one) on
    the general path and on the split path (the default): every request must read its own pages."""
    monkeypatch.setenv(flex.SPLIT_PATH_ENV, split_path)
    contexts = [3, 700, 1000, 257, 40, 500, 128, 33]
    batch = make_paged_batch([1] * len(contexts), contexts, 8, 8, 128, 16, torch.bfloat16, DEVICE, seed=9)
    builder = make_builder(Backend, batch, torch.bfloat16, "auto", (MAX_NUM_REQS, 2048, 2048))
    impl = make_impl(Backend, 8, 128, 8)
    meta = builder.build(batch.metadata)
    assert impl._use_split_path(meta, DEVICE) == (split_path == "1" and DEVICE.type == "cuda")
    shape = Backend.get_kv_cache_shape(batch.num_blocks, batch.block_size, 8, 128)
    kv_cache = (torch.randn(shape, device=DEVICE) * 100).to(torch.bfloat16)
    batch.fill_cache(kv_cache[0], kv_cache[1])
    out = impl.forward(None, batch.query, batch.new_keys, batch.new_values, kv_cache, meta)
    assert not flex.compile_failures(), flex.compile_failures()
    check(out, batch.reference(128**-0.5), torch.bfloat16)
