"""The fused decoder-layer kernels (kvllm/layers/ops) against the layers' torch code, on the CPU interpreter.

The reference is the layer modules themselves with the fused path switched off. Where the kernel
reorders a float32 sum (the norms) or its exp differs in the last float32 bit (numpy's in the
interpreter against torch's CPU kernel; on the GPU both call libdevice), an intermediate 16-bit rounding
can flip by one ulp in a few places, which the following product turns into at most two ulps of the
result; everything else must be bit-identical.
bfloat16 runs here too: the kernels round bfloat16 by hand under the interpreter, whose own cast truncates.
"""

from __future__ import annotations

import pytest
import torch

from kvllm.attention.ops.triton_reshape_and_cache import reshape_and_cache
from kvllm.layers.activation import SiluAndMul
from kvllm.layers.norm import RMSNorm
from kvllm.layers.ops.activation import silu_and_mul
from kvllm.layers.ops.dispatch import fused_ops_mode, use_fused_ops
from kvllm.layers.ops.rms_norm import fused_add_rms_norm, rms_norm
from kvllm.layers.ops.rotary import qk_norm_rope, qk_norm_rope_kv_write
from kvllm.layers.rotary import RotaryEmbedding
from tests import layer_ops_checks as checks
from tests.layer_ops_checks import bits

DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"]
)
EPS = 1e-6
TOL32 = 2e-6  # float32: summation order only
SENTINEL = 7.0  # exact in every cache dtype below; marks cache entries that must stay untouched


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def assert_matches_eager(out: torch.Tensor, ref: torch.Tensor, exact: bool = False) -> None:
    checks.assert_matches_eager(out, ref, TOL32, exact)


def assert_qk_norm_rope_matches(
    out: torch.Tensor, ref: torch.Tensor, head_size: int, rotary_dim: int
) -> None:
    checks.assert_qk_norm_rope_matches(out, ref, head_size, rotary_dim, TOL32)


def eager(module: torch.nn.Module, *args: torch.Tensor):  # noqa: ANN201
    with fused_ops_mode("0"), torch.no_grad():
        return module(*args)


def random_norm(hidden_size: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden_size, EPS).to(dtype)
    norm.weight.data = randn(hidden_size, dtype=dtype, seed=seed)
    return norm


# ---- RMSNorm ------------------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("num_tokens,hidden_size", [(7, 576), (1, 960), (5, 1536), (3, 64), (0, 960)])
def test_rms_norm(dtype, num_tokens, hidden_size) -> None:
    norm = random_norm(hidden_size, dtype, seed=1)
    x = randn(num_tokens, hidden_size, dtype=dtype, seed=2, scale=3.0)
    assert_matches_eager(rms_norm(x, norm.weight, EPS), eager(norm, x))


@DTYPES
@pytest.mark.parametrize("num_tokens,hidden_size", [(7, 576), (1, 960), (5, 1536), (0, 64)])
def test_fused_add_rms_norm(dtype, num_tokens, hidden_size) -> None:
    norm = random_norm(hidden_size, dtype, seed=3)
    x = randn(num_tokens, hidden_size, dtype=dtype, seed=4)
    residual = randn(num_tokens, hidden_size, dtype=dtype, seed=5, scale=4.0)
    ref_out, ref_residual = eager(norm, x, residual)
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, EPS)
    assert_matches_eager(new_residual, ref_residual, exact=True)  # the add is one rounding, no sum
    assert_matches_eager(out, ref_out)
    # In place: the outputs may be the inputs.
    fused_add_rms_norm(x, residual, norm.weight, EPS, out=x, residual_out=residual)
    assert torch.equal(bits(x), bits(out)) and torch.equal(bits(residual), bits(new_residual))


def test_rms_norm_strided_rows_and_leading_dims() -> None:
    norm = random_norm(96, torch.float16, seed=6)
    wide = randn(6, 200, dtype=torch.float16, seed=7)
    x = wide[:, 8:104]  # row stride 200
    assert_matches_eager(rms_norm(x, norm.weight, EPS), eager(norm, x))
    x3 = randn(2, 3, 96, dtype=torch.float16, seed=8)
    assert_matches_eager(rms_norm(x3, norm.weight, EPS), eager(norm, x3))


def test_rms_norm_promotes_like_torch() -> None:
    """An fp32 weight over fp16 activations gives an fp32 result, as `weight * normed` does in torch."""
    norm = RMSNorm(128, EPS)
    norm.weight.data = randn(128, dtype=torch.float32, seed=9)
    x = randn(4, 128, dtype=torch.float16, seed=10)
    out = rms_norm(x, norm.weight, EPS)
    assert out.dtype == torch.float32
    assert_matches_eager(out, eager(norm, x))


# ---- SiluAndMul ---------------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("num_tokens,d", [(7, 576), (1, 1536), (3, 80), (0, 64)])
def test_silu_and_mul(dtype, num_tokens, d) -> None:
    x = randn(num_tokens, 2 * d, dtype=dtype, seed=11, scale=3.0)
    assert_matches_eager(silu_and_mul(x), eager(SiluAndMul(), x))


# ---- QK-norm + RoPE -----------------------------------------------------------------------------------


def make_rope(head_size: int, partial: float) -> RotaryEmbedding:
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
    return RotaryEmbedding(head_size, 4096, params)


def eager_qk_norm_rope(qkv, positions, rope, num_heads, num_kv_heads, head_size, q_norm, k_norm):  # noqa: ANN001, ANN201
    """What LlamaAttention's torch path makes of qkv, as one [T, (H + 2 Hkv) * D] tensor."""
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], -1)
    if q_norm is not None:
        q = eager(q_norm, q.reshape(num_tokens, -1, head_size)).reshape(num_tokens, -1)
        k = eager(k_norm, k.reshape(num_tokens, -1, head_size)).reshape(num_tokens, -1)
    q, k = rope.apply(rope.cos_sin(positions, qkv.dtype), q, k)
    return torch.cat([q, k, v], dim=-1)


QK_CASES = pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,partial,qk_norm",
    [
        (4, 2, 128, 1.0, True),  # Qwen3-like
        (4, 2, 64, 1.0, False),  # Llama-like
        (3, 3, 80, 1.0, True),  # non-power-of-two head, MHA
        (4, 1, 96, 0.5, True),  # partial rotary, rotated half 24 of a padded 32
        (2, 2, 256, 0.25, False),
        (6, 2, 128, 1.0, True),
        (16, 8, 128, 1.0, True),  # Qwen3-0.6B: 24 heads in two programs per token
        (12, 2, 80, 0.5, False),  # 16 heads of a padded 40 + 32 + 16
    ],
    ids=["qwen3", "llama", "d80", "d96-partial", "d256-partial", "gqa3", "qwen3-0.6b", "d80-partial"],
)


@DTYPES
@QK_CASES
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_qk_norm_rope(dtype, num_heads, num_kv_heads, head_size, partial, qk_norm, num_tokens) -> None:
    rope = make_rope(head_size, partial)
    q_norm = random_norm(head_size, dtype, seed=12) if qk_norm else None
    k_norm = random_norm(head_size, dtype, seed=13) if qk_norm else None
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, seed=14, scale=2.0)
    positions = torch.randint(0, 4096, (num_tokens,), generator=torch.Generator().manual_seed(15))
    ref = eager_qk_norm_rope(qkv, positions, rope, num_heads, num_kv_heads, head_size, q_norm, k_norm)
    out = qkv.clone()
    qk_norm_rope(out, positions, rope.cos_sin_cache, num_heads, num_kv_heads, head_size,
                 q_norm and q_norm.weight, k_norm and k_norm.weight, EPS)  # fmt: skip
    if qk_norm:
        assert_qk_norm_rope_matches(out, ref, head_size, rope.rotary_dim)
    else:  # no sum to reorder: every rounding is the eager one
        assert_matches_eager(out, ref, exact=True)


def test_qk_norm_rope_no_tokens_and_int32_positions() -> None:
    rope = make_rope(64, 1.0)
    qkv = torch.empty(0, 4 * 64, dtype=torch.float16)
    qk_norm_rope(qkv, torch.empty(0, dtype=torch.int64), rope.cos_sin_cache, 2, 1, 64)
    qkv = randn(3, 4 * 64, dtype=torch.float16, seed=16)
    positions = torch.tensor([0, 7, 4095])
    ref = eager_qk_norm_rope(qkv, positions, rope, 2, 1, 64, None, None)
    qk_norm_rope(qkv, positions.int(), rope.cos_sin_cache, 2, 1, 64)
    assert_matches_eager(qkv, ref, exact=True)


# ---- QK-norm + RoPE + KV-cache write ------------------------------------------------------------------


def cache_views(layout: str, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Key and value caches as each backend hands them over, filled with SENTINEL."""
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    if layout == "separate":
        return torch.full(shape, SENTINEL).to(dtype), torch.full(shape, SENTINEL).to(dtype)
    if layout == "stacked":  # TRITON_ATTN, FLASH_ATTN: (2, blocks, ...) -> kv_cache[0], kv_cache[1]
        kv = torch.full((2, *shape), SENTINEL).to(dtype)
        return kv[0], kv[1]
    kv = torch.full((num_blocks, 2, *shape[1:]), SENTINEL).to(dtype)  # FLASHINFER: kv_cache[:, i]
    return kv[:, 0], kv[:, 1]


@pytest.mark.parametrize(
    "dtype,cache_dtype,k_scale,v_scale",
    [
        (torch.float16, torch.float16, 1.0, 1.0),
        (torch.bfloat16, torch.bfloat16, 1.0, 1.0),
        (torch.float32, torch.float32, 1.0, 1.0),
        (torch.float16, torch.float8_e4m3fn, 0.37, 1.7),
        (torch.bfloat16, torch.float8_e5m2, 2.5, 0.21),
        (torch.float32, torch.float8_e4m3fn, 1.0, 0.5),
    ],
    ids=["fp16", "bf16", "fp32", "e4m3-fp16", "e5m2-bf16", "e4m3-fp32"],
)
@pytest.mark.parametrize("layout", ["separate", "stacked", "flashinfer"])
def test_qk_norm_rope_kv_write(dtype, cache_dtype, k_scale, v_scale, layout) -> None:
    """The fused write stores the same bytes as qk_norm_rope followed by reshape_and_cache."""
    num_tokens, num_heads, num_kv_heads, head_size, block_size, num_blocks = 9, 4, 2, 80, 16, 3
    rope = make_rope(head_size, 0.5)
    q_norm, k_norm = random_norm(head_size, dtype, seed=17), random_norm(head_size, dtype, seed=18)
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, seed=19, scale=2.0)
    positions = torch.randint(0, 4096, (num_tokens,), generator=torch.Generator().manual_seed(20))
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(21))[:num_tokens]
    slots[[0, 4]] = -1  # CUDA-graph padding
    scales = torch.tensor(k_scale), torch.tensor(v_scale)
    weights = dict(q_weight=q_norm.weight, k_weight=k_norm.weight, eps=EPS)

    ref_qkv = qkv.clone()
    qk_norm_rope(ref_qkv, positions, rope.cos_sin_cache, num_heads, num_kv_heads, head_size, **weights)
    ref_k, ref_v = cache_views(layout, num_blocks, block_size, num_kv_heads, head_size, cache_dtype)
    kv_view = ref_qkv.view(num_tokens, num_heads + 2 * num_kv_heads, head_size)
    reshape_and_cache(kv_view[:, num_heads : num_heads + num_kv_heads], kv_view[:, num_heads + num_kv_heads :],
                      ref_k, ref_v, slots, *scales)  # fmt: skip

    out_k, out_v = cache_views(layout, num_blocks, block_size, num_kv_heads, head_size, cache_dtype)
    qk_norm_rope_kv_write(qkv, positions, rope.cos_sin_cache, num_heads, num_kv_heads, head_size,
                          out_k, out_v, slots, *scales, **weights)  # fmt: skip
    assert torch.equal(bits(qkv), bits(ref_qkv))
    assert torch.equal(bits(out_k), bits(ref_k))
    assert torch.equal(bits(out_v), bits(ref_v))
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for cache in (out_k, out_v):
        rows = cache.float().flatten(0, 1)  # [slot, Hkv, D]
        assert (rows[~written] == SENTINEL).all() and not (rows[written] == SENTINEL).all()


@DTYPES
@pytest.mark.parametrize("rotary_fraction,qk_norm", [(0.5, True), (0.5, False), (1.0, True)])
def test_qk_norm_rope_kv_write_into_q_out(dtype, rotary_fraction, qk_norm) -> None:
    """With q_out the rotated q (the passed-through dims included) lands there bit for bit as it would in
    qkv; qkv keeps its q part as it was, its k part and the cache are as without q_out."""
    num_tokens, num_heads, num_kv_heads, head_size, block_size, num_blocks = 7, 4, 2, 64, 16, 2
    rope = make_rope(head_size, rotary_fraction)
    weights = {}
    if qk_norm:
        q_norm, k_norm = random_norm(head_size, dtype, seed=31), random_norm(head_size, dtype, seed=32)
        weights = dict(q_weight=q_norm.weight, k_weight=k_norm.weight, eps=EPS)
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, seed=33, scale=2.0)
    positions = torch.randint(0, 4096, (num_tokens,), generator=torch.Generator().manual_seed(34))
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(35))[:num_tokens]
    q_width = num_heads * head_size

    ref_qkv = qkv.clone()
    ref_k, ref_v = cache_views("separate", num_blocks, block_size, num_kv_heads, head_size, dtype)
    qk_norm_rope_kv_write(ref_qkv, positions, rope.cos_sin_cache, num_heads, num_kv_heads, head_size,
                          ref_k, ref_v, slots, **weights)  # fmt: skip
    out_qkv = qkv.clone()
    out_k, out_v = cache_views("separate", num_blocks, block_size, num_kv_heads, head_size, dtype)
    shared = torch.full((num_tokens + 3, q_width + 16), float("nan"), dtype=dtype)  # rows of a wider buffer
    q_out = shared[:num_tokens, :q_width]
    qk_norm_rope_kv_write(out_qkv, positions, rope.cos_sin_cache, num_heads, num_kv_heads, head_size,
                          out_k, out_v, slots, **weights, q_out=q_out)  # fmt: skip
    assert torch.equal(bits(q_out), bits(ref_qkv[:, :q_width]))
    assert torch.equal(bits(out_qkv[:, :q_width]), bits(qkv[:, :q_width]))  # q left in qkv as it was
    assert torch.equal(bits(out_qkv[:, q_width:]), bits(ref_qkv[:, q_width:]))
    assert torch.equal(bits(out_k), bits(ref_k)) and torch.equal(bits(out_v), bits(ref_v))
    assert shared[num_tokens:].isnan().all() and shared[:, q_width:].isnan().all()  # nothing outside q_out
    with pytest.raises(ValueError, match="q_out must be"):
        qk_norm_rope_kv_write(out_qkv, positions, rope.cos_sin_cache, num_heads, num_kv_heads, head_size,
                              out_k, out_v, slots, **weights, q_out=q_out.t())  # fmt: skip


# ---- preconditions and dispatch -----------------------------------------------------------------------


def test_wrappers_reject_bad_layouts() -> None:
    rope = make_rope(64, 1.0)
    weight = torch.ones(64, dtype=torch.float16)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        rms_norm(torch.randn(64, 4).half().t(), weight, EPS)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.randn(4, 32).half(), weight, EPS)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(torch.randn(4, 64).half(), torch.randn(4, 64), weight, EPS)
    with pytest.raises(ValueError, match=r"\[\.\.\., 2 \* d\]"):
        silu_and_mul(torch.randn(3, 7))
    qkv = torch.randn(2, 4 * 64).half()
    with pytest.raises(ValueError, match="qkv must be"):
        qk_norm_rope(qkv, torch.arange(2), rope.cos_sin_cache, 2, 2, 64)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        qk_norm_rope(qkv, torch.arange(2), rope.cos_sin_cache.half(), 2, 1, 64)
    with pytest.raises(ValueError, match="both"):
        qk_norm_rope(qkv, torch.arange(2), rope.cos_sin_cache, 2, 1, 64, q_weight=weight)
    with pytest.raises(ValueError, match="positions"):
        qk_norm_rope(qkv, torch.arange(3), rope.cos_sin_cache, 2, 1, 64)
    cache = torch.zeros(2, 16, 1, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale"):
        qk_norm_rope_kv_write(
            qkv, torch.arange(2), rope.cos_sin_cache, 2, 1, 64, cache, cache, torch.arange(2)
        )
    with pytest.raises(ValueError, match="slot_mapping"):
        qk_norm_rope_kv_write(qkv, torch.arange(2), rope.cos_sin_cache, 2, 1, 64, cache.half(), cache.half(),
                              torch.arange(1))  # fmt: skip


def test_dispatch_modes() -> None:
    x = torch.zeros(1)
    with fused_ops_mode("auto"):
        assert not use_fused_ops(x)  # CPU tensors take the torch path unless forced
    with fused_ops_mode("1"):
        assert use_fused_ops(x)
        with fused_ops_mode("0"):
            assert not use_fused_ops(x)
        assert use_fused_ops(x)
    with pytest.raises(ValueError, match="not valid"):
        with fused_ops_mode("yes"):
            pass
