"""FLASH_ATTN (FlashAttention-4) on a GPU: every declared combination against the float32 reference.

The walk is derived from FlashAttentionBackend's declarations, so a declaration cannot claim
more than this test runs: dtypes x KV dtypes x head sizes x block sizes x features (none,
sliding window, soft-cap, sinks), each on a mixed batch (decodes first, fresh and chunked
prefills) over scrambled block tables, writing K/V through impl.forward (kvllm.attention.testing).
Blocks no request uses hold NaN, so reading past a sequence shows up as NaN.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from kvllm.attention.backend import AttentionSelectorConfig
from kvllm.attention.backends.flash_attn import FlashAttentionBackend as Backend
from kvllm.attention.testing import random_sinks, run_backend_case, shard
from kvllm.platforms.interface import DeviceInfo

# KVLLM_GPU_TEST_DEVICE=cpu dry-runs the harness against a stand-in kernel module (not a GPU check).
DEVICE = torch.device(os.environ.get("KVLLM_GPU_TEST_DEVICE", "cuda"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(Backend.missing_package_reason() is not None, reason="flash_attn.cute not installed"),
]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}  # max |err| / max |ref|
NUM_HEADS, NUM_KV_HEADS = 16, 8
WINDOW, SOFT_CAP = 24, 2.0
# Decodes first (one spanning exactly two pages of 16), then a fresh prompt and two chunked prefills.
QUERY_LENS = [1, 1, 1, 1, 37, 5, 70]
CONTEXT_LENS = [0, 31, 80, 130, 0, 57, 19]


def declared_cases() -> list[tuple[str, str, int, int, str]]:
    """(dtype, kv_cache_dtype, head_size, block_size, feature) for every declared combination."""
    features = ["none"] + [
        f
        for f, on in (
            ("window", Backend.supports_sliding_window),
            ("softcap", Backend.supports_logits_soft_cap),
        )
        if on
    ]
    if Backend.supports_sink:
        features.append("sink")
    cases = []
    for dtype, kv, head, block, feature in itertools.product(
        Backend.supported_dtypes,
        Backend.supported_kv_cache_dtypes,
        Backend.head_sizes.values,
        Backend.block_sizes.values,
        features,
    ):
        config = AttentionSelectorConfig(head_size=head, dtype=dtype, kv_cache_dtype=kv, block_size=block)
        if not Backend.validate_configuration(config, DeviceInfo("cuda", (9, 0))):
            cases.append((dtype, kv, head, block, feature))
    return cases


def run_case(
    dtype: torch.dtype,
    head_size: int,
    block_size: int,
    feature: str,
    query_lens: list[int] = QUERY_LENS,
    context_lens: list[int] = CONTEXT_LENS,
    num_heads: int = NUM_HEADS,
    num_kv_heads: int = NUM_KV_HEADS,
    pad_tokens: int = 0,
    seed: int = 0,
) -> float:
    """Relative max error of impl.forward against the float32 reference (also checks the cache write)."""
    case = run_backend_case(
        Backend, query_lens, context_lens, num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE,
        seed=seed, pad_tokens=pad_tokens, poison_unused_pages=True, builder_limits=(64, 4096, 4096),
        sliding_window=WINDOW if feature == "window" else None,
        logits_soft_cap=SOFT_CAP if feature == "softcap" else None,
        sinks=random_sinks(num_heads, seed, DEVICE) if feature == "sink" else None,
    )  # fmt: skip
    out, query, n = case.out, case.query, case.num_tokens
    assert out.shape == query.shape and out.dtype == dtype
    assert torch.isfinite(out[:n]).all(), "non-finite output: a kernel read a page it should not"
    written_k = case.written_keys()
    assert torch.equal(written_k, case.batch.new_keys), "new keys not written at their slots"
    return case.rel_max_error()


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype", "head_size", "block_size", "feature"), shard(declared_cases())
)
def test_declared_combination(
    dtype: str, kv_cache_dtype: str, head_size: int, block_size: int, feature: str
) -> None:
    err = run_case(DTYPES[dtype], head_size, block_size, feature)
    assert err < TOLERANCE[DTYPES[dtype]], f"relative error {err:.3e}"


@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [([1] * 6, [0, 15, 16, 17, 200, 999]), ([9, 128, 3], [0, 0, 250]), ([1], [4095])],
    ids=["decode_only", "prefill_only", "one_long_decode"],
)
def test_batch_shapes(query_lens: list[int], context_lens: list[int]) -> None:
    err = run_case(torch.bfloat16, 128, 16, "none", query_lens, context_lens)
    assert err < TOLERANCE[torch.bfloat16], f"relative error {err:.3e}"


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 8), (32, 4), (8, 1)], ids=["mha", "gqa8", "mqa"])
def test_head_groupings(num_heads: int, num_kv_heads: int) -> None:
    err = run_case(torch.bfloat16, 128, 16, "none", num_heads=num_heads, num_kv_heads=num_kv_heads)
    assert err < TOLERANCE[torch.bfloat16], f"relative error {err:.3e}"


def test_padding_slots_are_skipped_and_zeroed() -> None:
    err = run_case(torch.bfloat16, 128, 32, "none", pad_tokens=5)
    assert err < TOLERANCE[torch.bfloat16], f"relative error {err:.3e}"
