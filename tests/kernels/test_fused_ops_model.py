"""Whole models with the fused layer kernels forced on (CPU interpreter) against the same models' torch path.

Covers the wiring: RMSNorm / SiluAndMul / LlamaAttention dispatch, DeepSeek's MLA RoPE and MoE, in-place QK-norm + RoPE on the qkv
buffer, strided q/k/v views reaching attention (the profile path here, CPU_ATTN's paged cache in the
engine test), and the small-M linear kernel for the four projections of decode-sized batches (never the
LM head).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvllm import LLM, SamplingParams
from kvllm.config.engine import EngineArgs
from kvllm.forward_context import set_forward_context
from kvllm.layers.ops.dispatch import fused_ops_mode
from kvllm.models.loader import load_model
from kvllm.models.model_config import ModelConfig

CPU = torch.device("cpu")
KERNEL_WRAPPERS = [
    ("kvllm.layers.ops.rms_norm", "rms_norm"),
    ("kvllm.layers.ops.rms_norm", "fused_add_rms_norm"),
    ("kvllm.layers.ops.activation", "silu_and_mul"),
    ("kvllm.layers.ops.rotary", "qk_norm_rope"),
    ("kvllm.layers.ops.rotary", "qk_norm_rope_kv_write"),
    ("kvllm.layers.ops.linear", "linear"),
    ("kvllm.layers.ops.gemv", "gemv"),
    ("kvllm.layers.ops.gemv", "gemv_silu_and_mul"),
    ("kvllm.layers.ops.mla_rope", "mla_rope"),
    ("kvllm.layers.moe.fused_moe_triton", "fused_experts_triton"),
]
MODELS = pytest.mark.parametrize("fixture", ["tiny_qwen3_path", "tiny_llama_path", "tiny_qwen2_path"])


def logits(path: Path, dtype: str, input_ids: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    model = load_model(
        ModelConfig.from_engine_args(EngineArgs(model=str(path), dtype=dtype), CPU), "auto", CPU
    )
    with fused_ops_mode(mode), torch.no_grad(), set_forward_context(None):
        hidden = model(input_ids, torch.arange(input_ids.shape[0]))
        return hidden, model.compute_logits(hidden)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts calls of each kernel wrapper (the layers import them at call time, so this sees them)."""
    import importlib

    calls: dict[str, int] = {}
    for module_name, name in KERNEL_WRAPPERS:
        module = importlib.import_module(module_name)
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


@MODELS
def test_hidden_states_and_logits_match_torch_path(
    fixture: str, request: pytest.FixtureRequest, kernel_calls: dict[str, int]
) -> None:
    path = request.getfixturevalue(fixture)
    input_ids = torch.randint(3, 400, (37,), generator=torch.Generator().manual_seed(0))
    ref_hidden, ref_logits = logits(path, "float32", input_ids, "0")
    assert not kernel_calls
    hidden, out_logits = logits(path, "float32", input_ids, "1")
    # 2 layers: input norms (one plain in layer 0), post-attention norms + final norm, MLPs, attentions;
    # 37 rows are too many for the small-M linear kernel.
    assert kernel_calls == {"rms_norm": 1, "fused_add_rms_norm": 4, "silu_and_mul": 2, "qk_norm_rope": 2}
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(out_logits.argmax(-1), ref_logits.argmax(-1))


@MODELS
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_sized_batch_runs_the_projections_in_the_linear_kernel(
    fixture: str, dtype: str, request: pytest.FixtureRequest, kernel_calls: dict[str, int]
) -> None:
    path = request.getfixturevalue(fixture)
    input_ids = torch.randint(3, 400, (5,), generator=torch.Generator().manual_seed(2))
    ref_hidden, ref_logits = logits(path, dtype, input_ids, "0")
    assert not kernel_calls
    hidden, out_logits = logits(path, dtype, input_ids, "1")
    assert kernel_calls["linear"] == 2 * 4  # qkv, o, gate_up, down of 2 layers; not the LM head
    if dtype == "float32":
        torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out_logits, ref_logits, rtol=1e-5, atol=1e-5)
    else:
        assert (out_logits - ref_logits).abs().max() <= 0.02 * ref_logits.abs().max()
    assert torch.equal(out_logits.argmax(-1), ref_logits.argmax(-1))


def test_deepseek_v3_matches_torch_path(tiny_deepseek_v3_path: Path, kernel_calls: dict[str, int]) -> None:
    """DeepSeek-V3 (q LoRA, MLA RoPE kernel, the MoE layer's grouped GEMMs with the Triton alignment)."""
    input_ids = torch.randint(3, 400, (37,), generator=torch.Generator().manual_seed(3))
    ref_hidden, ref_logits = logits(tiny_deepseek_v3_path, "float32", input_ids, "0")
    assert not kernel_calls
    hidden, out_logits = logits(tiny_deepseek_v3_path, "float32", input_ids, "1")
    assert kernel_calls["mla_rope"] == 2 and kernel_calls["fused_experts_triton"] == 1  # 2 layers, 1 MoE
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_bf16_logits_match_torch_path(tiny_qwen3_path: Path) -> None:
    """bfloat16 end to end: only float32 summation order in the norms may move a value by an ulp."""
    input_ids = torch.randint(3, 400, (21,), generator=torch.Generator().manual_seed(1))
    _, ref_logits = logits(tiny_qwen3_path, "bfloat16", input_ids, "0")
    _, out_logits = logits(tiny_qwen3_path, "bfloat16", input_ids, "1")
    assert (out_logits - ref_logits).abs().max() <= 0.02 * ref_logits.abs().max()
    assert torch.equal(out_logits.argmax(-1), ref_logits.argmax(-1))


def test_engine_greedy_tokens_match_torch_path(tiny_qwen3_path: Path, kernel_calls: dict[str, int]) -> None:
    llm = LLM(str(tiny_qwen3_path), dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 21)
    prompts = ["The capital of France is", "Once upon a time, there was"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with fused_ops_mode("0"):
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with fused_ops_mode("1"):
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert kernel_calls["qk_norm_rope"] >= 2 * 6  # every step of both layers
    # The four projections of both layers, every decode step: two rows, narrow outputs, so the GEMV
    # (gate_up with SiLU in its epilogue).
    assert kernel_calls["gemv"] >= 2 * 3 * 5
    assert kernel_calls["gemv_silu_and_mul"] >= 2 * 5
    assert out == ref


def test_engine_with_the_kv_write_fused_into_rope_matches_torch_path(
    tiny_qwen3_path: Path, kernel_calls: dict[str, int]
) -> None:
    """TRITON_ATTN offers its cache views: the RoPE kernel stores K/V and the backend skips its write."""
    from kvllm.platforms import simulate_platform

    with simulate_platform("cuda", (9, 0)):
        llm = LLM(
            str(tiny_qwen3_path),
            dtype="float32",
            max_model_len=128,
            kv_cache_memory_bytes=1 << 21,
            attention_backend="TRITON_ATTN",
        )
    prompts = ["The capital of France is", "Once upon a time, there was"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with fused_ops_mode("0"):
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not kernel_calls
    with fused_ops_mode("1"):
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert kernel_calls["qk_norm_rope_kv_write"] >= 2 * 5 and "qk_norm_rope" not in kernel_calls
    assert out == ref
