"""Declared equals implemented, for the MLA backends that run here: every declared model dtype x KV-cache
dtype, a spread of latent widths and block sizes, through the backend's builder and implementation
(latent write, absorbed decode, up-projected prefill with cached context) against the float32 reference
of MLA without absorption. CPU_MLA natively; TRITON_MLA under the Triton interpreter (as on SM 9.0).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvllm.attention import registry  # noqa: E402
from kvllm.attention.backend import AttentionSelectorConfig  # noqa: E402
from kvllm.attention.mla_testing import MLADims, mla_reference, prepare_mla_case  # noqa: E402
from kvllm.config.choices import FP8_KV_CACHE_DTYPES  # noqa: E402
from kvllm.platforms import current_device_info  # noqa: E402
from kvllm.platforms.interface import DeviceInfo  # noqa: E402
from tests.unit.test_declared_equals_implemented import TOLERANCE, TORCH_DTYPES, _spread  # noqa: E402

DEVICE = current_device_info()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TORCH_DEVICE = "cuda" if DEVICE.platform == "cuda" else "cpu"
K_SCALE = 0.25
# Latent widths as (kv_lora_rank, rope): the tiny test model's, an odd split, DeepSeek's own.
LATENTS = {40: (32, 8), 72: (48, 24), 576: (512, 64)}
# fp8 latents: rounding to 3 mantissa bits, far coarser than the model dtype.
FP8_TOLERANCE = (8e-2, 2e-1)


def runs_here(backend) -> bool:
    if not backend.is_mla or not backend.implemented:
        return False
    return DEVICE.platform in backend.platforms or (backend.name == "TRITON_MLA" and INTERPRETED)


def cases_for(backend) -> list[tuple[str, str, int, int]]:
    widths = [w for w in LATENTS if backend.head_sizes.allows(w)]
    blocks = _spread(backend.block_sizes, [backend.preferred_block_size, 16, 32], limit=3)
    base_w, base_b = widths[0], backend.preferred_block_size
    cases = []
    for dtype in backend.supported_dtypes:
        cases += [(dtype, kv, base_w, base_b) for kv in backend.supported_kv_cache_dtypes]
        cases += [(dtype, "auto", w, base_b) for w in widths[1:]]
        cases += [(dtype, "auto", base_w, b) for b in blocks if b != base_b]
    return list(dict.fromkeys(cases))


def _params() -> list[object]:
    params = []
    for name in registry.registered_backend_names():
        backend = registry.get_backend_class(name)
        if not runs_here(backend):
            continue
        for dtype, kv, width, block in cases_for(backend):
            marks = []
            if INTERPRETED and name == "TRITON_MLA" and dtype == "bfloat16":
                marks.append(
                    pytest.mark.skip(reason="bfloat16 tl.dot is broken in the Triton CPU interpreter")
                )
            params.append(
                pytest.param(
                    name, dtype, kv, width, block, id=f"{name}-{dtype}-kv_{kv}-w{width}-b{block}", marks=marks
                )
            )
    return params


@pytest.mark.parametrize(("name", "dtype", "kv_cache_dtype", "width", "block_size"), _params())
def test_mla_declared_combination_matches_reference(name, dtype, kv_cache_dtype, width, block_size):
    backend = registry.get_backend_class(name)
    device = DEVICE if DEVICE.platform in backend.platforms else DeviceInfo("cuda", (9, 0))
    config = AttentionSelectorConfig(
        head_size=width, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size, use_mla=True
    )
    assert backend.validate_configuration(config, device) == [], "the walk only runs declared combinations"
    rank, rope = LATENTS[width]
    dims = MLADims(num_heads=4, kv_lora_rank=rank, qk_rope_head_dim=rope)
    fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
    # Decodes first (one with a long context), then prefill chunks with and without cached context.
    case = prepare_mla_case(
        backend, [1, 1, 6, 11], [37, 3, 19, 0], dims, block_size, TORCH_DTYPES[dtype], TORCH_DEVICE,
        seed=7, kv_cache_dtype=kv_cache_dtype, k_scale=K_SCALE if fp8 else 1.0,
    )  # fmt: skip
    out = case.first_layer().float()
    ref = mla_reference(case)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    rel_tol, abs_tol = FP8_TOLERANCE if fp8 else TOLERANCE[TORCH_DTYPES[dtype]]
    rel = ((out - ref).norm() / ref.norm()).item()
    max_abs = (out - ref).abs().max().item()
    assert rel < rel_tol and max_abs < abs_tol, f"relative error {rel:.2e}, max abs {max_abs:.2e}"


def test_every_mla_backend_that_runs_here_is_walked():
    walked = {p.values[0] for p in _params()}  # type: ignore[attr-defined]
    expected = {"CPU_MLA"} if DEVICE.platform == "cpu" else set()
    if INTERPRETED:
        expected.add("TRITON_MLA")
    assert expected <= walked
