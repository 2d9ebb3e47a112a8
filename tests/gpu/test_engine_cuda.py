"""On a CUDA GPU: engine greedy ids in bfloat16, for every GPU backend present, judged against HF float32.

The reference is HF transformers in float32 on the same weights. bf16 rounding may legitimately
flip a greedy choice where the float32 top two are close, after which the continuations differ.
So each prompt must follow the float32 reference token for token until the end, or until a step
where the flip is within bf16's own reach: HF's bf16 run of the same model on the same prefix
moves the logits there by `bf16_error = max |logits_bf16 - logits_fp32|`, so it can reorder two
tokens whose float32 logits are less than 2 * bf16_error apart. The bound is measured at each
divergence, not fixed; every divergence is recorded (written to $KVLLM_GPU_REPORT_DIR when set).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from kvllm import LLM, SamplingParams
from tests.hf_reference import _hf_model, hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_NEW_TOKENS = 24
BACKENDS = ["TRITON_ATTN", "FLEX_ATTENTION", "FLASH_ATTN", "FLASHINFER"]


@torch.inference_mode()
def _bf16_error_at(path: str, prefix: list[int], fp32_logits: torch.Tensor) -> float:
    """How far HF's own bf16 run moves the next-token logits after `prefix` from float32's."""
    model = _hf_model(path, torch.bfloat16, "cuda")
    logits = model(torch.tensor([prefix], device="cuda")).logits[0, -1].float().cpu()
    return float((logits - fp32_logits).abs().max())


def _backend_usable(name: str) -> str | None:
    from kvllm.attention.backend import AttentionSelectorConfig
    from kvllm.attention.registry import get_backend_class, is_registered
    from kvllm.platforms import current_device_info

    if not is_registered(name):
        return f"{name} is not registered in this build"
    reasons = get_backend_class(name).validate_configuration(
        AttentionSelectorConfig(head_size=128, dtype="bfloat16"), current_device_info()
    )
    return "; ".join(reasons) or None


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_bf16_matches_hf_fp32(qwen3_small, backend):
    why_not = _backend_usable(backend)
    if why_not:
        pytest.skip(why_not)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (1, 7, 33, 128, 257, 500, 700, 1000)]
    llm = LLM(
        qwen3_small,
        dtype="bfloat16",
        attention_backend=backend,
        max_num_batched_tokens=512,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    report = []
    for prompt, out in zip(prompts, outs):
        ours = out.outputs[0].token_ids
        ref, _, logits = hf_greedy(qwen3_small, prompt, MAX_NEW_TOKENS, dtype=torch.float32, device="cuda")
        step = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        entry = {"prompt_len": len(prompt), "matched_tokens": MAX_NEW_TOKENS if step is None else step}
        if step is not None:
            fp32 = logits[step]
            entry["fp32_gap"] = float(fp32[ref[step]] - fp32[ours[step]])  # >= 0: fp32's argmax is ref
            entry["bf16_error"] = _bf16_error_at(qwen3_small, prompt + ref[:step], fp32)
        report.append(entry)
    if out_dir := os.environ.get("KVLLM_GPU_REPORT_DIR"):
        with open(os.path.join(out_dir, f"greedy_bf16_vs_fp32_{backend}.json"), "w") as f:
            json.dump(
                {
                    "backend": backend,
                    "engine_backend": llm.llm_engine.attention_backend_name,
                    "prompts": report,
                },
                f,
                indent=1,
            )
    assert llm.llm_engine.attention_backend_name == backend
    for entry in report:
        if "fp32_gap" in entry:
            assert entry["fp32_gap"] <= 2 * entry["bf16_error"], f"a flip bf16 cannot explain: {entry}"
