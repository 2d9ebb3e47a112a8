"""The W4A16 and block-fp8 Triton kernels on the CPU interpreter against float32 plain torch, and
the quantized layers' kernel dispatch (fused ops on) against their dequantize-and-matmul path.

W4A16: the kernel rounds the dequantized weight to x's dtype (as dequantize + F.linear does) and
accumulates in float32, so a 16-bit result is within about one ulp of the float32 product of x with
the rounded weight. Block fp8: fp8 products are exact in float32; the sums differ by order only.
"""

from __future__ import annotations

import pytest
import torch

from kvllm.layers.ops.dispatch import fused_ops_mode
from kvllm.layers.quantization.ops.fp8 import FP8, block_fp8_linear, dequantize_block, quantize_fp8
from kvllm.layers.quantization.ops.int4_layout import (
    dequantize,
    pack_int4,
    pack_kernel_layout,
    unpack_int4,
    unpack_kernel_layout,
)
from kvllm.layers.quantization.ops.w4a16 import W4A16Config, w4a16_linear, w4a16_triton

TOLERANCES = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2), torch.float32: (1e-5, 1e-4)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_int4(n: int, k: int, group: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = _gen(seed)
    qweight = pack_kernel_layout(torch.randint(0, 16, (n, k), generator=g))
    scales = (0.01 + 0.02 * torch.rand(n, k // group, generator=g)).to(dtype)
    zeros = torch.randint(0, 16, (n, k // group), generator=g).to(dtype)
    return qweight, scales, zeros


def test_pack_roundtrip() -> None:
    values = torch.randint(0, 16, (5, 64), generator=_gen(0))
    assert torch.equal(unpack_int4(pack_int4(values)).long(), values)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"]
)
@pytest.mark.parametrize(
    "m,n,k,group,with_bias",
    [
        (1, 96, 256, 128, False),
        (3, 40, 512, 64, True),
        (16, 64, 256, 256, False),
        (20, 72, 256, 128, True),
        (130, 136, 256, 32, True),
    ],
)
def test_w4a16_matches_float32_reference(dtype, m, n, k, group, with_bias) -> None:
    """Small M with split-K (K 512 over few columns), a 16-row tile, 64-row tiles, and 128-row tiles
    with a partial last tile and group size 32."""
    qweight, scales, zeros = random_int4(n, k, group, dtype, seed=m + n)
    x = torch.randn(m, k, generator=_gen(m)).to(dtype)
    bias = torch.randn(n, generator=_gen(n)).to(dtype) if with_bias else None
    out = w4a16_triton(x, qweight, scales, zeros, group, bias)
    weight = dequantize(qweight, scales, zeros, group).to(dtype).float()
    expected = x.float() @ weight.T + (bias.float() if bias is not None else 0)
    rtol, atol = TOLERANCES[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("gather", [False, True], ids=["reshape", "gather"])
def test_w4a16_split_k_and_unpack_configs(split_k, gather) -> None:
    qweight, scales, zeros = random_int4(48, 512, 128, torch.float16, seed=1)
    x = torch.randn(2, 512, generator=_gen(2)).half()
    config = W4A16Config(16, 32, 128, split_k, gather=gather)
    out = w4a16_triton(x, qweight, scales, zeros, 128, config=config)
    expected = x.float() @ dequantize(qweight, scales, zeros, 128).half().float().T
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("m,block_m", [(20, 16), (33, 32), (64, 64)])
def test_w4a16_split_k_beyond_sixteen_rows(m, block_m) -> None:
    """Split K with more rows than the small-M tile: each split's partial holds every row."""
    qweight, scales, zeros = random_int4(40, 512, 128, torch.float16, seed=m)
    x = torch.randn(m, 512, generator=_gen(m + 1)).half()
    bias = torch.randn(40, generator=_gen(m + 2)).half()
    out = w4a16_triton(x, qweight, scales, zeros, 128, bias, config=W4A16Config(block_m, 32, 128, 4))
    expected = x.float() @ dequantize(qweight, scales, zeros, 128).half().float().T + bias.float()
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("block_k", [128, 256], ids=["four_groups_per_tile", "eight_groups_per_tile"])
def test_w4a16_tiles_spanning_groups(block_k) -> None:
    qweight, scales, zeros = random_int4(40, 256, 32, torch.float16, seed=6)
    x = torch.randn(3, 256, generator=_gen(7)).half()
    out = w4a16_triton(x, qweight, scales, zeros, 32, config=W4A16Config(16, 32, block_k, 2))
    expected = x.float() @ dequantize(qweight, scales, zeros, 32).half().float().T
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3)


def test_w4a16_act_order_gathers_inputs() -> None:
    qweight, scales, zeros = random_int4(32, 128, 32, torch.float32, seed=3)
    perm = torch.randperm(128, generator=_gen(4))
    x = torch.randn(3, 128, generator=_gen(5))
    with fused_ops_mode("1"):
        out = w4a16_linear(x, qweight, scales, zeros, 32, perm=perm)
    expected = x[:, perm] @ dequantize(qweight, scales, zeros, 32).T
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


def test_w4a16_rejects_bad_shapes() -> None:
    qweight, scales, zeros = random_int4(32, 128, 32, torch.float32, seed=3)
    with pytest.raises(ValueError, match="qweight"):
        w4a16_triton(torch.randn(2, 64), qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match="scales and zeros"):
        w4a16_triton(torch.randn(2, 128), qweight, scales, zeros, 64)


@pytest.mark.parametrize("m,n,k", [(1, 128, 256), (5, 192, 384), (70, 256, 128), (130, 144, 256)])
def test_block_fp8_matches_float32_reference(m, n, k) -> None:
    g = _gen(m)
    x = torch.randn(m, k, generator=g).half()
    weight = torch.randn(n, k, generator=g).to(FP8)
    scale_inv = 0.001 + 0.01 * torch.rand(-(-n // 128), k // 128, generator=g)
    out = block_fp8_linear(x, weight, scale_inv, (128, 128))
    xq, x_scale = quantize_fp8(x, 128)
    x_deq = xq.float() * x_scale.repeat_interleave(128, dim=1)
    expected = x_deq @ dequantize_block(weight, scale_inv, (128, 128)).T
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3)


def test_quantize_fp8_per_token() -> None:
    x = torch.randn(4, 256, generator=_gen(9)) * torch.tensor([[0.1], [1.0], [10.0], [0.0]])
    q, scale = quantize_fp8(x)
    assert q.dtype == FP8 and scale.shape == (4, 1)
    assert torch.equal(q.float().abs().amax(1)[:3], torch.full((3,), 448.0))
    torch.testing.assert_close(q.float() * scale, x, rtol=0.07, atol=1e-6)  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("group", [None, 128])
def test_quantize_fp8_kernel_matches_torch(group) -> None:
    """Bit-exact: both divide in IEEE float32 and round to nearest even."""
    x = torch.randn(5, 384, generator=_gen(11)) * 3
    q_ref, s_ref = quantize_fp8(x, group)
    with fused_ops_mode("1"):
        q, s = quantize_fp8(x, group)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=0, atol=0)


def test_kernel_layout_places_value_in_its_nibble() -> None:
    """The layout's definition: value j * B + b of each 8B-value block sits in nibble j of word b."""
    from kvllm.layers.quantization.ops.int4_layout import block_words

    for k in (128, 384, 64, 24):
        values = torch.randint(0, 16, (3, k), generator=_gen(k))
        words, packed = block_words(k), pack_kernel_layout(values)
        for n, index in ((0, 0), (1, k - 1), (2, k // 2 + 1), (2, k // 3)):
            block, offset = divmod(index, 8 * words)
            j, b = divmod(offset, words)
            word = int(packed[n, block * words + b]) & 0xFFFFFFFF
            assert (word >> (4 * j)) & 0xF == values[n, index]
        assert torch.equal(unpack_kernel_layout(packed).long(), values)


GEMV_CASES = [
    # m, n, k, group, bias, config (block_n, block_k, warps) or None, dtype
    (1, 96, 256, 128, False, None, torch.bfloat16),
    (2, 40, 512, 128, True, (4, 256, 1), torch.float16),  # two K tiles
    (
        3,
        24,
        384,
        128,
        False,
        (2, 256, 2),
        torch.float32,
    ),  # a partial last tile (masked blocks), rows padded to 4
    (
        4,
        36,
        512,
        32,
        True,
        (8, 512, 1),
        torch.bfloat16,
    ),  # N not a multiple of block_n; groups shorter than a block
    (1, 20, 192, 64, False, (4, 64, 1), torch.float16),  # K not a multiple of 128: 8-word blocks
    (2, 16, 256, 256, False, (1, 128, 1), torch.float32),  # one group per column (group = K)
    (1, 12, 80, 80, True, None, torch.float32),  # 2-word blocks: each thread holds 2 words
    (3, 12, 40, 40, False, None, torch.bfloat16),  # 1-word blocks
]


@pytest.mark.parametrize("m,n,k,group,with_bias,config,dtype", GEMV_CASES)
def test_w4a16_gemv_matches_float32_reference(dtype, m, n, k, group, with_bias, config) -> None:
    """Against x @ W^T in float32 with the exact (unrounded) dequantized weight: the kernel never
    rounds W, so the only 16-bit rounding is the output's."""
    from kvllm.layers.quantization.ops.w4a16_gemv import W4A16GemvConfig, w4a16_gemv

    qweight, scales, zeros = random_int4(n, k, group, dtype, seed=m * n + k)
    x = torch.randn(m, k, generator=_gen(k + m)).to(dtype)
    bias = torch.randn(n, generator=_gen(n)).to(dtype) if with_bias else None
    out = w4a16_gemv(x, qweight, scales, zeros, group, bias, W4A16GemvConfig(*config) if config else None)
    expected = x.float() @ dequantize(qweight, scales, zeros, group).T + (bias.float() if with_bias else 0)
    rtol, atol = TOLERANCES[dtype]
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("m,n,k,group,with_bias,config,dtype", [GEMV_CASES[1], GEMV_CASES[3]])
def test_w4a16_gemv_silu_and_mul(m, n, k, group, with_bias, config, dtype) -> None:
    """The fused gate_up epilogue: the projection, silu and product each rounded to x's dtype, as the
    unfused path does."""
    from kvllm.layers.quantization.ops.w4a16_gemv import W4A16GemvConfig, w4a16_gemv_silu_and_mul

    qweight, scales, zeros = random_int4(2 * n, k, group, dtype, seed=n + k)
    x = torch.randn(m, k, generator=_gen(k)).to(dtype)
    bias = torch.randn(2 * n, generator=_gen(n)).to(dtype) if with_bias else None
    out = w4a16_gemv_silu_and_mul(x, qweight, scales, zeros, group, bias, W4A16GemvConfig(*config))
    y = (x.float() @ dequantize(qweight, scales, zeros, group).T + (bias.float() if with_bias else 0)).to(
        dtype
    )
    gate, up = y.float().split(n, dim=1)
    expected = torch.nn.functional.silu(gate).to(dtype).float() * up
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)


def test_w4a16_gemv_rejects_bad_operands() -> None:
    from kvllm.layers.quantization.ops.w4a16_gemv import W4A16GemvConfig, w4a16_gemv, w4a16_gemv_silu_and_mul

    qweight, scales, zeros = random_int4(16, 256, 128, torch.float32, seed=1)
    with pytest.raises(ValueError, match="M <= 4"):
        w4a16_gemv(torch.randn(5, 256), qweight, scales, zeros, 128)
    with pytest.raises(ValueError, match="qweight"):
        w4a16_gemv(torch.randn(1, 128), qweight, scales, zeros, 128)
    with pytest.raises(ValueError, match="block_k"):
        w4a16_gemv(torch.randn(1, 256), qweight, scales, zeros, 128, config=W4A16GemvConfig(2, 64))
    with pytest.raises(ValueError, match="even number"):
        w4a16_gemv_silu_and_mul(torch.randn(1, 256), qweight[:15], scales[:15], zeros[:15], 128)


MMA_CASES = [
    # m, n, k, group, bias, (block_n, block_k, warps, stages, split_k), dtype
    (1, 64, 256, 128, False, (32, 128, 1, 2, 1), torch.bfloat16),
    (3, 40, 512, 256, True, (16, 256, 1, 2, 1), torch.float16),  # N not a multiple of block_n, rows padded
    (4, 96, 1024, 1024, False, (32, 256, 2, 2, 2), torch.bfloat16),  # one group for all of K, K split
    (2, 48, 384, 128, True, (16, 128, 1, 1, 3), torch.bfloat16),  # an odd split
]


@pytest.mark.parametrize("m,n,k,group,with_bias,config,dtype", MMA_CASES)
def test_w4a16_gemv_mma_matches_float32_reference(m, n, k, group, with_bias, config, dtype) -> None:
    """The tensor-core GEMV (its interpreter form of the pair decode), plain and gated, against x @ W^T in
    float32 with the exact dequantized weight, zeros between the integers included (M + z stays in
    float32); a split gives the same bits on a second call."""
    from kvllm.layers.quantization.ops.w4a16_gemv import W4A16GemvConfig, w4a16_gemv, w4a16_gemv_silu_and_mul

    conf = W4A16GemvConfig(*config[:4], split_k=config[4], mma=True)
    qweight, scales, zeros = random_int4(n, k, group, dtype, seed=m * n + k)
    zeros = zeros + 0.375 * (torch.rand(zeros.shape, generator=_gen(k)) > 0.5).to(dtype)
    x = torch.randn(m, k, generator=_gen(k + m)).to(dtype)
    bias = torch.randn(n, generator=_gen(n)).to(dtype) if with_bias else None
    out = w4a16_gemv(x, qweight, scales, zeros, group, bias, conf)
    expected = x.float() @ dequantize(qweight, scales, zeros, group).T + (bias.float() if with_bias else 0)
    rtol, atol = TOLERANCES[dtype]
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)
    assert torch.equal(w4a16_gemv(x, qweight, scales, zeros, group, bias, conf), out)

    q2, s2, z2 = random_int4(2 * n, k, group, dtype, seed=n + 1)
    bias2 = torch.cat([bias, -bias]) if with_bias else None
    gated = w4a16_gemv_silu_and_mul(x, q2, s2, z2, group, bias2, conf)
    y = (x.float() @ dequantize(q2, s2, z2, group).T + (bias2.float() if with_bias else 0)).to(dtype).float()
    expected_gated = torch.nn.functional.silu(y[:, :n]).to(dtype).float() * y[:, n:]
    torch.testing.assert_close(gated.float(), expected_gated, rtol=rtol, atol=atol)


MMA_GEMM_CASES = [
    # m, n, k, group, bias, (block_m, block_n, split_k, num_warps, num_stages, one_dot), dtype
    (5, 64, 256, 128, True, (16, 64, 1), torch.bfloat16),  # rows padded to the tile
    (20, 72, 512, 256, False, (16, 64, 2), torch.float16),  # N not a multiple of block_n, K split
    (70, 128, 384, 384, True, (32, 64, 3), torch.bfloat16),  # one group for all of K, three row tiles
    (33, 64, 256, 128, False, (32, 64, 2), torch.bfloat16),  # a split cutting no group (128-value halves)
    (20, 72, 512, 256, True, (16, 64, 2, 4, 4, True), torch.bfloat16),  # the four pairs as one dot
    (9, 64, 256, 128, False, (16, 64, 1, 4, 4, True), torch.float16),
]


def test_permute_for_pairs_puts_each_value_where_its_pair_tile_reads_it() -> None:
    """Position 32 p + 2 c + e of a 128-value block holds value 16 p + 64 e + c: the K index of word c's
    nibble p + 4 e in the layout (nibble j of word c holds value 16 j + c)."""
    from kvllm.layers.quantization.ops.w4a16_gemm_mma import permute_for_pairs

    x = torch.randn(3, 256, generator=_gen(5))
    out = permute_for_pairs(x)
    for block in (0, 128):
        for p in range(4):
            for c in range(16):
                for e in range(2):
                    assert torch.equal(out[:, block + 32 * p + 2 * c + e], x[:, block + 16 * p + 64 * e + c])


@pytest.mark.parametrize("m,n,k,group,with_bias,config,dtype", MMA_GEMM_CASES)
def test_w4a16_gemm_mma_matches_float32_reference(m, n, k, group, with_bias, config, dtype) -> None:
    """The tensor-core GEMM (its interpreter form of the pair decode) against x @ W^T in float32 with W
    rounded to x's dtype, as dequantize + F.linear rounds it; a split gives the same bits twice."""
    from kvllm.layers.quantization.ops.w4a16_gemm_mma import W4A16MMAConfig, w4a16_gemm_mma

    conf = W4A16MMAConfig(*config)
    qweight, scales, zeros = random_int4(n, k, group, dtype, seed=m * n + k)
    x = torch.randn(m, k, generator=_gen(k + m)).to(dtype)
    bias = torch.randn(n, generator=_gen(n)).to(dtype) if with_bias else None
    out = w4a16_gemm_mma(x, qweight, scales, zeros, group, bias, conf)
    weight = dequantize(qweight, scales, zeros, group).to(dtype).float()
    expected = x.float() @ weight.T + (bias.float() if with_bias else 0)
    rtol, atol = TOLERANCES[dtype]
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)
    assert torch.equal(w4a16_gemm_mma(x, qweight, scales, zeros, group, bias, conf), out)


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 4096), (200, 384), (4096, 1152)])
def test_w4a16_gemm_mma_default_config_runs_at_every_row_count(n, k) -> None:
    """The default config is one the kernel accepts (row tile, column tile, a split of whole blocks) at every
    row count the dispatch sends it, odd K block counts included."""
    from kvllm.layers.quantization.ops.w4a16 import MMA_GEMM_MAX_ROWS, MMA_GEMM_MIN_ROWS
    from kvllm.layers.quantization.ops.w4a16_gemm_mma import default_mma_gemm_config, mma_gemm_refusal

    x = torch.empty(1, k, dtype=torch.bfloat16)
    for m in range(MMA_GEMM_MIN_ROWS, MMA_GEMM_MAX_ROWS + 1):
        config = default_mma_gemm_config(m, n, k)
        assert mma_gemm_refusal(x, k, 128, config) is None, (m, config)
        assert config.block_m >= min(m, 128), (m, config)  # a tile holds the rows, up to 128


def test_w4a16_gemm_mma_rejects_what_it_cannot_run() -> None:
    from kvllm.layers.quantization.ops.w4a16_gemm_mma import W4A16MMAConfig, w4a16_gemm_mma

    qweight, scales, zeros = random_int4(64, 256, 128, torch.bfloat16, seed=3)
    x = torch.randn(8, 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match="needs x in"):
        w4a16_gemm_mma(x.float(), qweight, scales.float(), zeros.float(), 128)
    q64, s64, z64 = random_int4(64, 256, 64, torch.bfloat16, seed=4)
    with pytest.raises(ValueError, match="multiples of 128"):
        w4a16_gemm_mma(x, q64, s64, z64, 64)
    with pytest.raises(ValueError, match="split_k 3"):
        w4a16_gemm_mma(x, qweight, scales, zeros, 128, config=W4A16MMAConfig(16, 64, split_k=3))
    with pytest.raises(ValueError, match="block_m"):
        w4a16_gemm_mma(x, qweight, scales, zeros, 128, config=W4A16MMAConfig(8, 64))
    with pytest.raises(ValueError, match="block_n"):
        w4a16_gemm_mma(x, qweight, scales, zeros, 128, config=W4A16MMAConfig(16, 32, num_warps=4))


def test_w4a16_gemm_mma_leaves_bf16_to_other_routes_below_sm80(monkeypatch) -> None:
    """Packed bf16 FMAs need SM 8.0: below it a bf16 call is refused (the dispatch then takes another route),
    an fp16 one is not."""
    from kvllm.layers.quantization.ops import w4a16_gemm_mma

    monkeypatch.setattr(w4a16_gemm_mma, "_capability", lambda x: (7, 5))
    x = torch.empty(8, 256, dtype=torch.bfloat16)
    assert "SM 8.0+" in w4a16_gemm_mma.mma_gemm_refusal(x, 256, 128)
    assert w4a16_gemm_mma.mma_gemm_refusal(x.half(), 256, 128) is None
    monkeypatch.setattr(w4a16_gemm_mma, "_capability", lambda x: (9, 0))
    assert w4a16_gemm_mma.mma_gemm_refusal(x, 256, 128) is None


def test_w4a16_gemv_mma_table_entry_gives_way_where_it_cannot_run(monkeypatch) -> None:
    """The tuned table is keyed by shape only: a tensor-core entry met by a float32 call or a 64-value group
    runs the default config instead of failing the layer; where it can run, it runs."""
    from kvllm.layers.quantization.ops import w4a16_gemv as mod

    entry = mod.W4A16GemvConfig(16, 128, mma=True)
    monkeypatch.setattr(mod, "tuned_config", lambda *args: entry)
    launched = []
    monkeypatch.setattr(mod, "launch_mma", lambda *args: launched.append(args))
    for dtype, group in ((torch.float32, 128), (torch.bfloat16, 64)):
        qweight, scales, zeros = random_int4(32, 256, group, dtype, seed=group)
        x = torch.randn(1, 256, generator=_gen(3)).to(dtype)
        out = mod.w4a16_gemv(x, qweight, scales, zeros, group)
        expected = x.float() @ dequantize(qweight, scales, zeros, group).T
        torch.testing.assert_close(
            out.float(), expected, rtol=TOLERANCES[dtype][0], atol=TOLERANCES[dtype][1]
        )
    assert not launched
    qweight, scales, zeros = random_int4(32, 256, 128, torch.bfloat16, seed=5)
    mod.w4a16_gemv(torch.randn(1, 256).bfloat16(), qweight, scales, zeros, 128)
    assert len(launched) == 1


def test_w4a16_gemv_mma_rejects_what_it_cannot_run() -> None:
    from kvllm.layers.quantization.ops.w4a16_gemv import W4A16GemvConfig, w4a16_gemv

    qweight, scales, zeros = random_int4(32, 256, 128, torch.bfloat16, seed=1)
    x = torch.randn(1, 256).bfloat16()
    with pytest.raises(ValueError, match="needs x in"):
        w4a16_gemv(
            x.float(), qweight, scales.float(), zeros.float(), 128, config=W4A16GemvConfig(16, 128, mma=True)
        )
    with pytest.raises(ValueError, match="dividing the group size 128"):
        w4a16_gemv(x, qweight, scales, zeros, 128, config=W4A16GemvConfig(16, 256, mma=True))
    with pytest.raises(ValueError, match="multiple of 16 x num_warps"):
        w4a16_gemv(x, qweight, scales, zeros, 128, config=W4A16GemvConfig(16, 128, num_warps=2, mma=True))
    with pytest.raises(ValueError, match="takes no paired"):
        w4a16_gemv(x, qweight, scales, zeros, 128, config=W4A16GemvConfig(16, 128, paired=True, mma=True))
    q64, s64, z64 = random_int4(32, 256, 64, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match="multiples of 128"):
        w4a16_gemv(x, q64, s64, z64, 64, config=W4A16GemvConfig(16, 128, mma=True))


@pytest.mark.parametrize("group", [128, 32])
@pytest.mark.parametrize(
    "block_n,values_per_row,num_warps",
    [(8, 512, 4), (16, 256, 4), (32, 512, 8), (8, 1024, 4)],
    ids=["default", "previous_default", "wide", "long"],
)
def test_dequantize_kernel_matches_reference(group, block_n, values_per_row, num_warps) -> None:
    """Every launch shape gives the same weight (rows and K blocks past the edge masked)."""
    from kvllm.layers.quantization.ops.w4a16 import dequantize_triton

    qweight, scales, zeros = random_int4(40, 384, group, torch.float16, seed=group)
    out = dequantize_triton(qweight, scales, zeros, group, torch.float16, block_n, values_per_row, num_warps)
    torch.testing.assert_close(out, dequantize(qweight, scales, zeros, group).half(), rtol=0, atol=0)


@pytest.mark.parametrize("m", [1, 9, 130])
def test_w4a16_linear_dispatch_matches_cpu_path(m, monkeypatch) -> None:
    """Each route of the fused dispatch (GEMV, Triton GEMM, dequantize + matmul from DEQUANT_MIN_ROWS,
    here lowered to 128) against the dequantize-and-matmul path, act order included."""
    from kvllm.layers.quantization.ops import w4a16

    monkeypatch.setattr(w4a16, "DEQUANT_MIN_ROWS", 128)
    qweight, scales, zeros = random_int4(48, 256, 64, torch.float32, seed=m)
    perm = torch.randperm(256, generator=_gen(m))
    x = torch.randn(m, 256, generator=_gen(m + 1))
    bias = torch.randn(48, generator=_gen(2))
    expected = w4a16_linear(x, qweight, scales, zeros, 64, bias, perm)
    with fused_ops_mode("1"):
        out = w4a16_linear(x, qweight, scales, zeros, 64, bias, perm)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,routed", [(2, True), (9, True), (1, False), (513, False)])
def test_w4a16_linear_routes_two_to_max_rows_of_16_bit_x_to_the_tensor_core_gemm(
    m, routed, monkeypatch
) -> None:
    """From MMA_GEMM_MIN_ROWS (2) to MMA_GEMM_MAX_ROWS, a bf16 x goes through the tensor-core GEMM (here on
    the interpreter) and matches the dequantize-and-matmul path; one row (the GEMV's) and more than the
    maximum do not."""
    from kvllm.layers.quantization.ops import w4a16, w4a16_gemm_mma

    calls = []
    real = w4a16_gemm_mma.w4a16_gemm_mma
    monkeypatch.setattr(
        w4a16_gemm_mma, "w4a16_gemm_mma", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw)
    )
    monkeypatch.setattr(w4a16, "DEQUANT_MIN_ROWS", 1 << 20)  # beyond the GEMM: the Triton GEMM, not cuBLAS
    qweight, scales, zeros = random_int4(64, 256, 128, torch.bfloat16, seed=m)
    x = torch.randn(m, 256, generator=_gen(m + 1)).to(torch.bfloat16)
    bias = torch.randn(64, generator=_gen(2)).to(torch.bfloat16)
    expected = w4a16_linear(x, qweight, scales, zeros, 128, bias)
    with fused_ops_mode("1"):
        out = w4a16_linear(x, qweight, scales, zeros, 128, bias)
    assert calls == ([(m, 256)] if routed else [])
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("group,fused", [(128, False), (64, True)])
def test_gated_int4_layer_at_two_rows_leaves_silu_to_the_gemm_route_where_it_runs(group, fused) -> None:
    """At two rows the gate_up projection goes to the tensor-core GEMM where it can run (16-bit x, groups of
    128), then SiLU: the gated GEMV's epilogue is skipped there and runs where the GEMM refuses (groups
    of 64). Either way the result matches the CPU reference's projection-then-activation."""
    from unittest import mock

    from kvllm.layers.activation import SiluAndMul
    from kvllm.layers.linear import MergedLinear
    from kvllm.layers.quantization.gptq import GPTQConfig
    from kvllm.layers.quantization.ops import w4a16_gemm_mma, w4a16_gemv

    config = GPTQConfig.from_config({"bits": 4, "group_size": group, "desc_act": False, "sym": True})
    dtype, default = torch.bfloat16, torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the layer's scales in x's dtype, as a bf16 model loads them
    try:
        layer = MergedLinear(256, [64, 64], quant_config=config, prefix="mlp.gate_up_proj")
    finally:
        torch.set_default_dtype(default)
    g = _gen(5)
    for param in layer.parameters():
        param.dummy_init(param.data, g)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(2, 256, generator=g).to(dtype)
    expected = SiluAndMul()(layer(x))
    with (
        fused_ops_mode("1"),
        mock.patch.object(w4a16_gemv, "_launch", wraps=w4a16_gemv._launch) as gemv,
        mock.patch.object(w4a16_gemm_mma, "w4a16_gemm_mma", wraps=w4a16_gemm_mma.w4a16_gemm_mma) as gemm,
    ):
        out = layer.gated(x, SiluAndMul())
    assert (gemv.call_count, gemm.call_count) == ((1, 0) if fused else (0, 1))
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_w4a16_gemm_mma_default_is_one_mma_chain_up_to_16_rows_except_on_long_k() -> None:
    """The twenty-ninth session's H100 sweep: up to 16 rows, 256-column tiles over 8 warps as one MMA chain
    on Llama-3-8B's qkv, o and gate_up (K split 4 ways, gate_up unsplit); down (K = 14,336) keeps 64
    columns over 4 warps, where the chain was slower."""
    from kvllm.layers.quantization.ops.w4a16_gemm_mma import W4A16MMAConfig, default_mma_gemm_config

    for m in (2, 4, 16):
        assert default_mma_gemm_config(m, 6144, 4096) == W4A16MMAConfig(16, 256, 4, 8, 4, one_dot=True)
        assert default_mma_gemm_config(m, 4096, 4096) == W4A16MMAConfig(16, 256, 4, 8, 4, one_dot=True)
        assert default_mma_gemm_config(m, 28672, 4096) == W4A16MMAConfig(16, 256, 1, 8, 4, one_dot=True)
        assert default_mma_gemm_config(m, 4096, 14336) == W4A16MMAConfig(16, 64, 4, 4, 4)
    assert not default_mma_gemm_config(512, 28672, 4096).one_dot  # not swept with the chain beyond 256 rows


def test_gated_int4_layer_fuses_silu_for_decode_rows() -> None:
    """MergedLinear.gated on an int4 layer with fused ops on runs the W4A16 GEMV's SiLU epilogue (one
    row) and matches the projection-then-activation path of the CPU reference."""
    from unittest import mock

    from kvllm.layers.activation import SiluAndMul
    from kvllm.layers.linear import MergedLinear
    from kvllm.layers.quantization.gptq import GPTQConfig
    from kvllm.layers.quantization.ops import w4a16_gemv

    config = GPTQConfig.from_config({"bits": 4, "group_size": 64, "desc_act": False, "sym": True})
    layer = MergedLinear(256, [64, 64], quant_config=config, prefix="mlp.gate_up_proj")
    g = _gen(3)
    for param in layer.parameters():
        param.dummy_init(param.data, g)  # random int4 values, zeros and scales; sequential g_idx
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(1, 256, generator=g)
    expected = SiluAndMul()(layer(x))
    with fused_ops_mode("1"), mock.patch.object(w4a16_gemv, "_launch", wraps=w4a16_gemv._launch) as launch:
        out = layer.gated(x, SiluAndMul())
    assert launch.call_args.args[-1] is True  # the gated kernel ran
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_w4a16_gemv_default_is_two_streams_of_four_columns_at_one_row() -> None:
    """At M = 1 every Llama-3-8B projection takes one warp per program and two 4-column weight streams
    (the H100 sweep's fastest on each), copied row-major into shared memory (gated: as Triton orders it);
    an odd width keeps one stream; at two rows narrow outputs still
    split K for enough warps."""
    from kvllm.layers.quantization.ops.w4a16_gemv import default_config

    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        config = default_config(1, n, k)
        assert (config.block_n, config.block_k, config.num_warps, config.num_stages) == (4, 1024, 1, 3)
        assert config.paired and config.flat_tile and config.split_k == 1
        assert not config.prefetch
    gated = default_config(1, 28672, 4096, gated=True)
    assert (gated.block_n, gated.block_k, gated.paired, gated.prefetch, gated.flat_tile) == (
        4,
        512,
        False,
        False,
        False,
    )
    assert not default_config(1, 20, 4096).paired
    assert default_config(2, 4096, 4096).num_warps == 2


SPLIT_K_CASES = [
    # m, n, k, group, bias, (block_n, block_k, warps, stages, prefetch, split_k), dtype
    (1, 40, 512, 128, True, (8, 128, 1, 1, True, 4), torch.float32),  # one tile per program
    (3, 36, 1024, 32, False, (4, 128, 1, 2, True, 2), torch.bfloat16),  # groups under a block, 4 tiles
    (4, 24, 512, 512, True, (8, 128, 1, 1, True, 2), torch.float16),  # one group for all of K
    (2, 20, 192, 64, False, (4, 64, 1, 1, True, 3), torch.float32),  # 8-word blocks, an odd split
]


@pytest.mark.parametrize("m,n,k,group,with_bias,config,dtype", SPLIT_K_CASES)
def test_w4a16_gemv_split_k_matches_float32_reference_and_repeats_bit_for_bit(
    m, n, k, group, with_bias, config, dtype
) -> None:
    """Split K: the parts summed in split order (no float atomics), so a second call (the tickets back to
    zero, the workspace reused) gives the same bits; gated too."""
    from kvllm.layers.quantization.ops.w4a16_gemv import (
        _SCRATCH,
        W4A16GemvConfig,
        w4a16_gemv,
        w4a16_gemv_silu_and_mul,
    )

    conf = W4A16GemvConfig(*config)
    qweight, scales, zeros = random_int4(n, k, group, dtype, seed=m * n + k)
    x = torch.randn(m, k, generator=_gen(k + m)).to(dtype)
    bias = torch.randn(n, generator=_gen(n)).to(dtype) if with_bias else None
    out = w4a16_gemv(x, qweight, scales, zeros, group, bias, conf)
    expected = x.float() @ dequantize(qweight, scales, zeros, group).T + (bias.float() if with_bias else 0)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)
    assert not _SCRATCH.buffers[x.device][1].any()  # every ticket back at zero
    assert torch.equal(w4a16_gemv(x, qweight, scales, zeros, group, bias, conf), out)

    q2, s2, z2 = random_int4(2 * n, k, group, dtype, seed=n + 1)
    gated = w4a16_gemv_silu_and_mul(x, q2, s2, z2, group, None, conf)
    unsplit = w4a16_gemv_silu_and_mul(x, q2, s2, z2, group, None, W4A16GemvConfig(*config[:5]))
    y = (x.float() @ dequantize(q2, s2, z2, group).T).to(dtype).float()
    expected_gated = torch.nn.functional.silu(y[:, :n]).to(dtype).float() * y[:, n:]
    torch.testing.assert_close(gated.float(), expected_gated, rtol=rtol, atol=atol)
    torch.testing.assert_close(gated, unsplit, rtol=rtol, atol=atol)


def test_w4a16_gemv_split_k_rejects_a_split_that_cuts_a_tile() -> None:
    from kvllm.layers.quantization.ops.w4a16_gemv import W4A16GemvConfig, w4a16_gemv

    qweight, scales, zeros = random_int4(16, 384, 128, torch.float32, seed=1)
    with pytest.raises(ValueError, match="split_k 2 must be >= 1 and cut K = 384 into whole tiles of 128"):
        w4a16_gemv(
            torch.randn(1, 384), qweight, scales, zeros, 128, config=W4A16GemvConfig(8, 128, split_k=2)
        )


def test_split_k_scratch_grows_outside_capture_only_and_keeps_old_buffers() -> None:
    """A graph captured earlier keeps pointing at the buffers it saw, so they are never freed; during a
    capture a call that needs more room gets None (and runs without the split)."""
    from kvllm.layers.quantization.ops.w4a16_gemv import _SplitKScratch

    scratch = _SplitKScratch()
    cpu = torch.device("cpu")
    assert scratch.get(cpu, 100, 4, capturing=True) is None
    ws, tickets = scratch.get(cpu, 100, 4, capturing=False)
    assert ws.numel() == 100 and tickets.numel() == 4 and not tickets.any()
    assert scratch.get(cpu, 50, 2, capturing=True)[0] is ws  # fits: served during a capture too
    assert scratch.get(cpu, 200, 2, capturing=True) is None
    bigger, more = scratch.get(cpu, 200, 2, capturing=False)
    assert bigger.numel() == 200 and more.numel() == 4 and scratch.retired == [ws, tickets]


def test_w4a16_gemv_tuned_table_is_read_per_gpu_model(tmp_path, monkeypatch) -> None:
    """The table's entry for this GPU's name and the call's (rows, n, k, gated), else None; a shipped table
    parses into configs the launcher accepts."""
    import json

    from kvllm.layers.quantization.ops import w4a16_gemv as mod

    table = tmp_path / "configs.json"
    entry = {"block_n": 8, "block_k": 512, "num_warps": 1, "num_stages": 2, "split_k": 4}
    table.write_text(json.dumps({"NVIDIA H100 80GB HBM3": {mod.tuned_key(1, 6144, 4096, False): entry}}))
    monkeypatch.setenv(mod.TUNED_CONFIGS_ENV, str(table))
    monkeypatch.setattr(mod.torch.cuda, "get_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(mod, "interpreting", lambda: False)
    mod._tuned_configs.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        assert mod.tuned_config(cuda, 1, 6144, 4096, False) == mod.W4A16GemvConfig(**entry)
        assert mod.tuned_config(cuda, 2, 6144, 4096, False) is None  # two rows: another key
        assert mod.tuned_config(cuda, 1, 6144, 4096, True) is None
        assert mod.tuned_config(torch.device("cpu"), 1, 6144, 4096, False) is None
        monkeypatch.setattr(mod.torch.cuda, "get_device_name", lambda index: "NVIDIA H200")
        mod._tuned_configs.cache_clear()
        assert mod.tuned_config(cuda, 1, 6144, 4096, False) is None
        table.write_text(json.dumps({"NVIDIA H200": {"1,8,64,0": {"block_n": 8, "tiles": 2}}}))
        mod._tuned_configs.cache_clear()
        with pytest.raises(ValueError, match="entry '1,8,64,0' is not a W4A16GemvConfig"):
            mod.tuned_config(cuda, 1, 8, 64, False)
        monkeypatch.setenv(mod.TUNED_CONFIGS_ENV, str(tmp_path / "missing.json"))
        mod._tuned_configs.cache_clear()
        with pytest.raises(ValueError, match="missing.json: no such file"):
            mod.tuned_config(cuda, 1, 8, 64, False)
    finally:
        mod._tuned_configs.cache_clear()
    if mod.TUNED_CONFIGS.exists():
        for entries in json.loads(mod.TUNED_CONFIGS.read_text()).values():
            for key, fields in entries.items():
                rows, n, k, gated = map(int, key.split(","))
                config = mod.W4A16GemvConfig(**fields)
                assert k % (config.block_k * config.split_k) == 0 and rows in (1, 2, 4) and gated in (0, 1)


@pytest.mark.parametrize(
    "m,n,k,group,with_bias,dtype",
    [
        (1, 48, 512, 128, True, torch.bfloat16),
        (4, 16, 256, 32, False, torch.float32),
        (3, 32, 384, 128, True, torch.float16),
    ],
)
def test_w4a16_gemv_paired_matches_float32_reference(m, n, k, group, with_bias, dtype) -> None:
    """Paired programs (2 x block_n columns as two weight streams): the same sums as one stream, the
    second half's columns and bias where they belong."""
    from kvllm.layers.quantization.ops.w4a16_gemv import W4A16GemvConfig, w4a16_gemv

    qweight, scales, zeros = random_int4(n, k, group, dtype, seed=m + n + k)
    x = torch.randn(m, k, generator=_gen(k - m)).to(dtype)
    bias = torch.randn(n, generator=_gen(n)).to(dtype) if with_bias else None
    expected = x.float() @ dequantize(qweight, scales, zeros, group).T + (bias.float() if with_bias else 0)
    rtol, atol = TOLERANCES[dtype]
    # K split too: both streams' parts parked, each half stored in place.
    for split in (1, 3 if k == 384 else 2):
        config = W4A16GemvConfig(4, 128, 1, 2, split_k=split, paired=True)
        out = w4a16_gemv(x, qweight, scales, zeros, group, bias, config)
        torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)
    with pytest.raises(ValueError, match="paired needs N = 20 a multiple of 2 x block_n"):
        q20, s20, z20 = random_int4(20, k, group, dtype, seed=1)
        w4a16_gemv(x, q20, s20, z20, group, None, W4A16GemvConfig(4, 128, paired=True))


@pytest.mark.parametrize(
    "m,n,k,group,config",
    [
        (1, 48, 512, 128, dict(block_n=4, block_k=256, num_stages=2, paired=True)),
        (3, 24, 384, 128, dict(block_n=2, block_k=256, num_warps=2)),  # a partial last tile (masked blocks)
        (4, 36, 512, 32, dict(block_n=8, block_k=512)),  # groups shorter than a block, N not a multiple
        (2, 16, 192, 64, dict(block_n=4, block_k=64, split_k=3)),  # 8-word blocks, and a split
    ],
)
def test_w4a16_gemv_flat_tile_matches_the_four_dimensional_tile(m, n, k, group, config) -> None:
    """flat_tile loads the same words as [block_n, words] and reshapes them: the same sums, bit for bit,
    plain and gated."""
    from kvllm.layers.quantization.ops.w4a16_gemv import W4A16GemvConfig, w4a16_gemv, w4a16_gemv_silu_and_mul

    qweight, scales, zeros = random_int4(n, k, group, torch.bfloat16, seed=m + n + k + group)
    x = torch.randn(m, k, generator=_gen(m * k)).to(torch.bfloat16)
    four_d, flat = W4A16GemvConfig(**config), W4A16GemvConfig(**config, flat_tile=True)
    out = w4a16_gemv(x, qweight, scales, zeros, group, None, flat)
    assert torch.equal(out, w4a16_gemv(x, qweight, scales, zeros, group, None, four_d))
    expected = x.float() @ dequantize(qweight, scales, zeros, group).T
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)
    if not config.get("paired"):  # the weight's rows as gate, then up (n is even)
        gated = w4a16_gemv_silu_and_mul(x, qweight, scales, zeros, group, None, flat)
        assert torch.equal(gated, w4a16_gemv_silu_and_mul(x, qweight, scales, zeros, group, None, four_d))
