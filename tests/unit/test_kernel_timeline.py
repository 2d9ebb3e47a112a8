"""benchmarks/h200/kernel_timeline.py: busy time, exclusive time and idle gaps from a kernel timeline."""

from __future__ import annotations

import pytest

from benchmarks.h200.kernel_timeline import kind_of, summarize


def test_overlapping_kernels_are_charged_once_and_gaps_bucketed() -> None:
    kernels = [
        # A GEMM, then an attention kernel launched with PDL: it starts 3 us before the GEMM ends.
        ("nvjet_tst_128x64_gemm", 0.0, 10.0),
        ("_unified_attention_kernel", 7.0, 27.0),
        # 2 us of launch latency, then an RMSNorm; 150 us of host stall, then sampling.
        ("_rms_norm_kernel", 29.0, 30.0),
        ("_gumbel_chunk_kernel", 180.0, 186.0),
        # A kernel wholly inside the previous one's span adds nothing.
        ("Memcpy HtoD", 181.0, 182.0),
    ]
    s = summarize(reversed(kernels), wall_us=200.0)
    assert s["kernels"] == 5
    assert s["busy_ms"] == pytest.approx((10 + 17 + 1 + 6) / 1e3)
    assert s["exclusive_ms_by_kind"] == pytest.approx(
        {"attention": 0.017, "gemm": 0.010, "sampling": 0.006, "norm": 0.001, "copies": 0.0}
    )
    assert s["idle_ms_by_gap"]["< 5 us"] == pytest.approx(0.002)
    assert s["idle_ms_by_gap"][">= 1000 us"] == 0.0
    assert s["idle_ms_by_gap"]["< 1000 us"] == pytest.approx(0.150)
    assert s["idle_gaps_by_length"]["< 1000 us"] == 1
    assert s["first_to_last_kernel_ms"] == pytest.approx(0.186)
    assert s["busy_fraction_of_wall"] == pytest.approx(34 / 200)
    attention = next(k for k in s["top_kernels"] if k["name"] == "_unified_attention_kernel")
    assert attention["own_ms"] == pytest.approx(0.020) and attention["exclusive_ms"] == pytest.approx(0.017)


@pytest.mark.parametrize(
    "name,kind",
    [
        ("_reduce_segments_kernel", "attention"),
        ("_small_m_linear_kernel", "gemm"),
        ("_qk_norm_rope_kernel", "rope + kv write"),
        ("_silu_and_mul_kernel", "activation"),
        ("void at::native::elementwise_kernel<...>", "other"),
    ],
)
def test_kinds(name, kind) -> None:
    assert kind_of(name) == kind


def test_empty_timeline() -> None:
    s = summarize([], wall_us=10.0)
    assert s["busy_ms"] == 0.0 and s["kernels"] == 0
