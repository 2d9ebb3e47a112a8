"""FLASHINFER on a GPU: every declared combination against the float32 reference.

The walk comes from FlashInferBackend's declarations: dtypes x KV dtypes (fp8 included) x head
sizes x block sizes x features, each on a mixed batch (decodes first, fresh and chunked
prefills) over scrambled block tables, through builder.build (plan) and impl.forward (K/V
write, decode run, prefill run) by kvllm.attention.testing. Pages no request reads hold NaN.

The `widen` walk runs what the kernel side implements but the backend does not declare yet
(FlashInferBackend.IMPLEMENTED_*: more head sizes and block sizes, sliding window, soft-cap):
once it passes on an H200, widen the declarations to match.

FlashInfer compiles one module per (dtype, KV dtype, head size, feature) on first use (one to two
minutes each on the H200), so cases are ordered by that group and KVLLM_GPU_SHARD=i/n gives each
of n processes whole groups.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from kvllm.attention.backend import AttentionSelectorConfig
from kvllm.attention.backends.flashinfer import FlashInferBackend as Backend
from kvllm.attention.backends.flashinfer import kv_dtype_mismatch_reasons
from kvllm.attention.testing import run_backend_case, shard
from kvllm.platforms.interface import DeviceInfo

# KVLLM_GPU_TEST_DEVICE=cpu dry-runs the harness against a stand-in kernel module (not a GPU check).
DEVICE = torch.device(os.environ.get("KVLLM_GPU_TEST_DEVICE", "cuda"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(Backend.missing_package_reason() is not None, reason="flashinfer not installed"),
]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_KV = ("fp8", "fp8_e4m3", "fp8_e5m2")
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}  # max |err| / max |ref|, vs dequantized K/V for fp8
K_SCALE, V_SCALE = 0.5, 2.0
NUM_HEADS, NUM_KV_HEADS = 16, 8  # GQA 2: CUDA-core decode; test_tensor_core_decode covers GQA >= 4
WINDOW, SOFT_CAP = 24, 2.0
QUERY_LENS = [1, 1, 1, 1, 37, 5, 70]
CONTEXT_LENS = [0, 31, 80, 130, 0, 57, 19]

Case = tuple[str, str, int, int, str]  # dtype, kv_cache_dtype, head_size, block_size, feature


def _features(window: bool, softcap: bool) -> list[str]:
    return ["none"] + [f for f, on in (("window", window), ("softcap", softcap)) if on]


DECLARED_AXES = (
    Backend.head_sizes.values,
    Backend.block_sizes.values,
    _features(Backend.supports_sliding_window, Backend.supports_logits_soft_cap),
)
IMPLEMENTED_AXES = (
    Backend.IMPLEMENTED_HEAD_SIZES,
    Backend.IMPLEMENTED_BLOCK_SIZES,
    _features(Backend.IMPLEMENTS_SLIDING_WINDOW, Backend.IMPLEMENTS_LOGITS_SOFT_CAP),
)


def _walk(kv_dtypes: tuple[str, ...], axes: tuple[tuple[int, ...], tuple[int, ...], list[str]]) -> list[Case]:
    """Cases ordered so that one compile group (dtype, KV dtype, head, feature) is contiguous."""
    heads, blocks, features = axes
    cases = []
    for dtype, kv, head, feature, block in itertools.product(
        Backend.supported_dtypes, kv_dtypes, heads, features, blocks
    ):
        config = AttentionSelectorConfig(head_size=head, dtype=dtype, kv_cache_dtype=kv, block_size=block)
        if not kv_dtype_mismatch_reasons(config):
            cases.append((dtype, kv, head, block, feature))
    return cases


def _compile_group(case: Case) -> tuple:
    """What FlashInfer compiles one module for: dtype, cache dtype, head size, feature."""
    return (case[0], CACHE_DTYPES.get(case[1], case[1]), case[2], case[4])


# Tests outside the walks run in shard 0 only.
first_shard_only = pytest.mark.skipif(
    os.environ.get("KVLLM_GPU_SHARD", "0/1").split("/")[0] != "0", reason="runs in shard 0"
)


def _validates(case: Case) -> bool:
    dtype, kv, head, block, feature = case
    config = AttentionSelectorConfig(
        head_size=head,
        dtype=dtype,
        kv_cache_dtype=kv,
        block_size=block,
        has_sliding_window=feature == "window",
        logits_soft_cap=SOFT_CAP if feature == "softcap" else None,
    )
    reasons = Backend.validate_configuration(config, DeviceInfo("cuda", (9, 0)))
    return reasons in ([], [Backend.missing_package_reason()])


def declared_cases() -> list[Case]:
    """The walk is exactly what validation accepts: the declared axes, less the (model dtype, cache dtype)
    pairs whose part beyond VERIFIED_* passed only for other pairs (VERIFIED_BY_DTYPES)."""
    v = Backend.verified_everywhere()
    everywhere = (v.head_sizes, v.block_sizes, _features(v.sliding_window, v.logits_soft_cap))
    assert all(_validates(c) for c in _walk(Backend.supported_kv_cache_dtypes, everywhere))
    return [c for c in _walk(Backend.supported_kv_cache_dtypes, DECLARED_AXES) if _validates(c)]


def widen_cases() -> list[Case]:
    """Implemented but not declared: the cases whose passing would let the declarations grow."""
    declared = set(declared_cases())
    kv_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")
    return [c for c in _walk(kv_dtypes, IMPLEMENTED_AXES) if c not in declared]


def run_case(
    dtype: torch.dtype,
    kv_cache_dtype: str,
    head_size: int,
    block_size: int,
    feature: str,
    query_lens: list[int] = QUERY_LENS,
    context_lens: list[int] = CONTEXT_LENS,
    num_heads: int = NUM_HEADS,
    num_kv_heads: int = NUM_KV_HEADS,
    pad_tokens: int = 0,
    steps: int = 1,
    seed: int = 0,
) -> float:
    """Relative max error of impl.forward against the float32 reference (also checks the cache write)."""
    fp8 = kv_cache_dtype in FP8_KV
    cache_dtype = CACHE_DTYPES.get(kv_cache_dtype, dtype)
    # Later steps reuse the wrappers (planned eagerly in build) and rewrite the same slots.
    case = run_backend_case(
        Backend, query_lens, context_lens, num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE,
        seed=seed, steps=steps, pad_tokens=pad_tokens, poison_unused_pages=True, builder_limits=(64, 4096, 4096),
        kv_cache_dtype=kv_cache_dtype, k_scale=K_SCALE if fp8 else 1.0, v_scale=V_SCALE if fp8 else 1.0,
        sliding_window=WINDOW if feature == "window" else None,
        logits_soft_cap=SOFT_CAP if feature == "softcap" else None,
    )  # fmt: skip
    out, query, n, batch = case.out, case.query, case.num_tokens, case.batch
    assert out.shape == query.shape and out.dtype == dtype
    assert torch.isfinite(out[:n]).all(), "non-finite output: a kernel read a page it should not"
    written_k = case.written_keys()
    expected_k = (batch.new_keys.float() / K_SCALE).to(cache_dtype) if fp8 else batch.new_keys
    assert torch.equal(written_k.float(), expected_k.float()), "new keys not written at their slots"
    return case.rel_max_error()


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype", "head_size", "block_size", "feature"), shard(declared_cases(), _compile_group)
)
def test_declared_combination(
    dtype: str, kv_cache_dtype: str, head_size: int, block_size: int, feature: str
) -> None:
    err = run_case(DTYPES[dtype], kv_cache_dtype, head_size, block_size, feature)
    assert err < TOLERANCE[DTYPES[dtype]], f"relative error {err:.3e}"


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype", "head_size", "block_size", "feature"), shard(widen_cases(), _compile_group)
)
def test_widen_combination(
    dtype: str, kv_cache_dtype: str, head_size: int, block_size: int, feature: str
) -> None:
    err = run_case(DTYPES[dtype], kv_cache_dtype, head_size, block_size, feature)
    assert err < TOLERANCE[DTYPES[dtype]], f"relative error {err:.3e}"


@first_shard_only
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [([1] * 6, [0, 15, 16, 17, 200, 999]), ([9, 128, 3], [0, 0, 250]), ([1], [4095])],
    ids=["decode_only", "prefill_only", "one_long_decode"],
)
def test_batch_shapes(query_lens: list[int], context_lens: list[int]) -> None:
    err = run_case(torch.bfloat16, "auto", 128, 16, "none", query_lens, context_lens)
    assert err < TOLERANCE[torch.bfloat16], f"relative error {err:.3e}"


@first_shard_only
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 8), (8, 1)], ids=["gqa4", "mqa"])
def test_tensor_core_decode(num_heads: int, num_kv_heads: int) -> None:
    err = run_case(torch.bfloat16, "auto", 128, 16, "none", num_heads=num_heads, num_kv_heads=num_kv_heads)
    assert err < TOLERANCE[torch.bfloat16], f"relative error {err:.3e}"


@first_shard_only
def test_padding_and_replanned_steps() -> None:
    err = run_case(torch.bfloat16, "auto", 128, 32, "none", pad_tokens=5, steps=3)
    assert err < TOLERANCE[torch.bfloat16], f"relative error {err:.3e}"
