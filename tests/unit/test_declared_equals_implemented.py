"""Declared equals implemented: every combination a backend's declaration claims runs and is right.

For each registered backend that runs here (its platform is this machine's; on a CPU machine also
TRITON_ATTN under the Triton interpreter), and for a spread of what it declares (dtypes x KV dtypes,
head sizes, block sizes, sliding window / soft-cap / sinks / non-causal), one small mixed batch goes
through the backend's metadata builder and implementation and is compared with the float32
reference. A declared combination that crashes or is wrong fails here, named by its test id.

Spread (to stay fast): every dtype x KV dtype at a base shape; every sampled head size and block
size per dtype; every supported feature alone and all together per dtype (all together also per KV dtype, once).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the import of any @triton.jit kernel (the kernel tests' conftest does the same).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvllm.attention import registry  # noqa: E402
from kvllm.attention.backend import (  # noqa: E402
    AttentionBackend,
    AttentionSelectorConfig,
    MultipleOf,
    OneOf,
)
from kvllm.config.choices import FP8_KV_CACHE_DTYPES  # noqa: E402
from kvllm.platforms import current_device_info  # noqa: E402
from kvllm.platforms.interface import DeviceInfo  # noqa: E402

DEVICE = current_device_info()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TORCH_DEVICE = "cuda" if DEVICE.platform in ("cuda", "rocm") else "cpu"

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# (max relative L2 error, max abs error) by the least precise dtype involved; outputs are O(1).
TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.float16: (5e-3, 2e-2), torch.bfloat16: (2e-2, 8e-2)}
FEATURES = ("sliding_window", "soft_cap", "sinks", "non_causal")
NUM_HEADS, NUM_KV_HEADS = 4, 2  # GQA: query head h reads KV head h // 2
SLIDING_WINDOW, SOFT_CAP = 8, 2.0
K_SCALE, V_SCALE = 0.5, 1.5  # used for fp8 caches (stored = value / scale)


def runs_here(backend: type[AttentionBackend]) -> bool:
    if backend.is_mla:  # MLA backends have their own contract and walk (test_mla_declared_equals_implemented)
        return False
    if DEVICE.platform in backend.platforms:
        return True
    return backend.name == "TRITON_ATTN" and INTERPRETED


def _spread(rule: MultipleOf | OneOf, anchors: list[int], limit: int = 4) -> list[int]:
    if isinstance(rule, OneOf):
        values = sorted(rule.values)
        if len(values) <= limit:
            return values
        return sorted({values[0], values[len(values) // 2], values[-1], *[a for a in anchors if a in values]})
    candidates = {rule.minimum or rule.factor, rule.maximum or 0, *anchors}
    out = set()
    for value in candidates:
        value = -(-value // rule.factor) * rule.factor if value > 0 else 0
        if value > 0 and rule.allows(value):
            out.add(value)
    return sorted(out)


def head_sizes(backend: type[AttentionBackend]) -> list[int]:
    # 80 and 96 are the odd sizes real models use; cap the spread at 256 for CPU speed.
    sizes = _spread(backend.head_sizes, [64, 80, 128, 256])
    small = [s for s in sizes if s <= 256]
    return small or sizes[:1]


def block_sizes(backend: type[AttentionBackend]) -> list[int]:
    rule = backend.block_sizes
    anchors = [backend.preferred_block_size]
    if isinstance(rule, MultipleOf):
        anchors += [rule.factor, 4 * rule.factor]
    return _spread(rule, anchors, limit=3)


def supported_features(backend: type[AttentionBackend]) -> list[str]:
    flags = {
        "sliding_window": backend.supports_sliding_window,
        "soft_cap": backend.supports_logits_soft_cap,
        "sinks": backend.supports_sink,
        "non_causal": backend.supports_non_causal,
    }
    return [f for f in FEATURES if flags[f]]


@dataclass(frozen=True)
class Case:
    backend: str
    dtype: str
    kv_cache_dtype: str
    head_size: int
    block_size: int
    features: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return (
            f"{self.backend}-{self.dtype}-kv_{self.kv_cache_dtype}-h{self.head_size}-b{self.block_size}-"
            + ("+".join(self.features) or "plain")
        )

    def selector_config(self) -> AttentionSelectorConfig:
        non_causal = "non_causal" in self.features
        return AttentionSelectorConfig(
            head_size=self.head_size,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            block_size=self.block_size,
            has_sink="sinks" in self.features,
            has_sliding_window="sliding_window" in self.features,
            logits_soft_cap=SOFT_CAP if "soft_cap" in self.features else None,
            use_non_causal=non_causal,
            attn_type=self.attn_type,
        )

    @property
    def attn_type(self) -> str:
        backend = registry.get_backend_class(self.backend)
        if "non_causal" in self.features and "encoder_only" in backend.attn_types:
            return "encoder_only"
        return "decoder"


def cases_for(backend: type[AttentionBackend]) -> list[Case]:
    name = backend.name
    heads, blocks = head_sizes(backend), block_sizes(backend)
    base_head = 64 if 64 in heads else heads[0]
    base_block = backend.preferred_block_size if backend.preferred_block_size in blocks else blocks[0]
    dtypes, kv_dtypes = backend.supported_dtypes, backend.supported_kv_cache_dtypes
    features = supported_features(backend)
    # Sliding window is defined for causal attention only; bidirectional layers are tested alone.
    together = tuple(f for f in features if f != "non_causal")
    cases: list[Case] = []
    for dtype in dtypes:
        cases += [Case(name, dtype, kv, base_head, base_block) for kv in kv_dtypes]
        cases += [Case(name, dtype, "auto", h, base_block) for h in heads]
        cases += [Case(name, dtype, "auto", base_head, b) for b in blocks]
        cases += [Case(name, dtype, "auto", base_head, base_block, (f,)) for f in features]
        if len(together) > 1:
            # Features x every KV dtype once (the model dtype matters little there), else auto only.
            kvs = kv_dtypes if dtype == dtypes[-1] else ("auto",)
            cases += [Case(name, dtype, kv, base_head, base_block, together) for kv in kvs]
    # Largest declared head with every feature, and the smallest block with fp8 if declared.
    if together:
        cases.append(Case(name, dtypes[0], "auto", heads[-1], blocks[0], together))
    return list(dict.fromkeys(cases))


def _params() -> list[object]:
    params: list[object] = []
    for name in registry.registered_backend_names():
        backend = registry.get_backend_class(name)
        if not runs_here(backend):
            continue
        for case in cases_for(backend):
            marks = []
            if name == "TRITON_ATTN" and INTERPRETED and case.dtype == "bfloat16":
                marks.append(
                    pytest.mark.skip(
                        reason="bfloat16 tl.dot is broken in the Triton CPU interpreter (errors ~1e10, see "
                        "shared/reference/gpu-machine.md); bf16 is covered on the GPU"
                    )
                )
            params.append(pytest.param(case, id=case.id, marks=marks))
    return params


def run_case(case: Case, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor]:
    from kvllm.attention.testing import run_backend_case

    monkeypatch.setenv(
        "KVLLM_FLEX_COMPILE", "0"
    )  # eager FlexAttention: the compile costs ~20 s per shape on CPU
    fp8 = case.kv_cache_dtype in FP8_KV_CACHE_DTYPES
    # Decodes first, then prefill chunks with and without cached context (encoder-only: no cache).
    encoder_only = case.attn_type == "encoder_only"
    query_lens, context_lens = ([5, 9], [0, 0]) if encoder_only else ([1, 1, 6, 11], [37, 3, 19, 0])
    max_model_len = 2 * max(q + c for q, c in zip(query_lens, context_lens)) + case.block_size
    result = run_backend_case(
        registry.get_backend_class(case.backend),
        query_lens,
        context_lens,
        NUM_HEADS,
        NUM_KV_HEADS,
        case.head_size,
        case.block_size,
        TORCH_DTYPES[case.dtype],
        TORCH_DEVICE,
        seed=1234,
        causal="non_causal" not in case.features,
        kv_cache_dtype=case.kv_cache_dtype,
        k_scale=K_SCALE if fp8 else 1.0,
        v_scale=V_SCALE if fp8 else 1.0,
        sliding_window=SLIDING_WINDOW if "sliding_window" in case.features else None,
        logits_soft_cap=SOFT_CAP if "soft_cap" in case.features else None,
        sinks=torch.linspace(-1.0, 2.0, NUM_HEADS).to(TORCH_DEVICE) if "sinks" in case.features else None,
        attn_type=case.attn_type,
        builder_limits=(8, 128, max_model_len),
    )
    return result.out, result.ref


@pytest.mark.parametrize("case", _params())
def test_declared_combination_runs_and_matches_reference(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = registry.get_backend_class(case.backend)
    # Interpreted Triton kernels stand in for an H200 (SM 9.0), where they would run.
    device = DEVICE if DEVICE.platform in backend.platforms else DeviceInfo("cuda", (9, 0))
    reasons = backend.validate_configuration(case.selector_config(), device)
    if reasons:
        # Declarations with extra rules (e.g. fp8 only on newer GPUs) do not claim this one here.
        pytest.skip(f"{case.backend} does not claim this combination on {device.describe()}: {reasons}")
    out, ref = run_case(case, monkeypatch)
    assert out.shape == ref.shape, f"output shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out = out.float()
    assert torch.isfinite(out).all(), "non-finite values in the output"
    involved = [TORCH_DTYPES[case.dtype]]
    if case.kv_cache_dtype in TORCH_DTYPES:
        involved.append(TORCH_DTYPES[case.kv_cache_dtype])
    precision = max(involved, key=lambda d: torch.finfo(d).eps)  # the least precise one
    rel_tol, abs_tol = TOLERANCE[precision]
    rel = ((out - ref).norm() / ref.norm()).item()
    max_abs = (out - ref).abs().max().item()
    assert rel < rel_tol and max_abs < abs_tol, (
        f"relative error {rel:.2e} (tol {rel_tol}), max abs {max_abs:.2e} (tol {abs_tol})"
    )


def test_every_backend_that_runs_here_is_walked() -> None:
    walked = {p.values[0].backend for p in _params()}  # type: ignore[attr-defined]
    assert "CPU_ATTN" in walked or DEVICE.platform != "cpu"
    for name in registry.registered_backend_names():
        if runs_here(registry.get_backend_class(name)):
            assert name in walked
