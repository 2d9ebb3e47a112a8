"""The fused MLA RoPE kernel against DeepseekRotaryEmbedding's torch path, on the CPU interpreter.

Both rotate in float32 with the same cos/sin and the same operation order and round once, so the
results are bit-identical here (on a GPU an FMA may move a float32 result by one ulp before rounding).
"""

from __future__ import annotations

import pytest
import torch

from kvllm.layers.deepseek_rotary import DeepseekRotaryEmbedding
from kvllm.layers.ops.dispatch import fused_ops_mode
from tests.model_factory import DEEPSEEK_YARN_ROPE


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "rotate_half"])
@pytest.mark.parametrize("num_heads,nope,rope", [(3, 16, 8), (20, 24, 16)], ids=["h3", "h20-two-blocks"])
def test_fused_rope_equals_torch_path(dtype, interleaved, num_heads, nope, rope):
    gen = torch.Generator().manual_seed(num_heads + rope)
    rotary = DeepseekRotaryEmbedding(rope, 512, DEEPSEEK_YARN_ROPE, interleaved=interleaved)
    num_tokens = 7
    positions = torch.randint(0, 512, (num_tokens,), generator=gen)
    q = torch.randn(num_tokens, num_heads, nope + rope, generator=gen).to(dtype)
    kv_a = torch.randn(num_tokens, 32 + rope, generator=gen).to(dtype)
    k_pe = kv_a[:, 32:]  # a column slice, as the model passes it
    with fused_ops_mode("0"):
        ref_q, ref_k = rotary.rotate_query_and_key(positions, q, k_pe, nope)
    with fused_ops_mode("1"):
        out_q, out_k = rotary.rotate_query_and_key(positions, q, k_pe, nope)
    assert out_q.is_contiguous() and out_k.is_contiguous()
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert not torch.equal(out_q[..., nope:], q[..., nope:])  # something was rotated


def test_mismatched_shapes_are_refused():
    from kvllm.layers.ops.mla_rope import mla_rope

    rotary = DeepseekRotaryEmbedding(8, 64, DEEPSEEK_YARN_ROPE)
    q = torch.randn(2, 4, 24)
    with pytest.raises(ValueError, match="rope dim"):
        mla_rope(torch.zeros(2, dtype=torch.long), rotary.cos_sin_cache, q, torch.randn(2, 6), 16, True)
