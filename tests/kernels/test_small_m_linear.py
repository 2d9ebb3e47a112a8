"""The small-M linear kernel (kvllm/layers/ops/linear.py) on the CPU interpreter, and the layers' dispatch.

The reference is the same product in float32 plain torch. The kernel accumulates in float32 and rounds
once to the output dtype, so a 16-bit result is within about one ulp of the reference (the rounding,
plus float32 summation order); float32 results differ by summation order only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvllm.layers.ops.linear as ops
from kvllm.layers.linear import Linear, MergedLinear, QKVLinear
from kvllm.layers.ops.dispatch import fused_ops_mode
from kvllm.layers.ops.linear import (
    BLOCK_N,
    MAX_ROWS,
    TARGET_PROGRAMS,
    LinearConfig,
    linear,
    use_small_m_kernel,
)

DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"]
)
ROWS = pytest.mark.parametrize("m", [1, 2, 3, 5, 8, MAX_ROWS])
# (rtol, atol) against the float32 reference. Outputs are sums of K <= 512 products of unit normals
# (|y| ~ sqrt K): float32 summation order moves one by up to ~K * 2^-24 * mean |product|, about 2e-5.
TOLERANCES = {torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 1e-2), torch.float32: (1e-5, 1e-4)}


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ weight.float().T
    return y if bias is None else y + bias.float()


def assert_close_to_reference(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    assert out.dtype == x.dtype and out.shape == (x.shape[0], weight.shape[0])
    rtol, atol = TOLERANCES[x.dtype]
    torch.testing.assert_close(out.float(), reference(x, weight, bias), rtol=rtol, atol=atol)


@DTYPES
@ROWS
@pytest.mark.parametrize("k,n", [(64, 96), (128, 40), (48, 33), (512, 24)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_matches_float32_reference(dtype, m, k, n, with_bias) -> None:
    """(48, 33): K below one tile and odd N; (512, 24): few column tiles, so the default splits K."""
    x = randn(m, k, dtype=dtype, seed=m)
    weight = randn(n, k, dtype=dtype, seed=100 + k)
    bias = randn(n, dtype=dtype, seed=200 + n) if with_bias else None
    assert_close_to_reference(linear(x, weight, bias), x, weight, bias)


@DTYPES
@pytest.mark.parametrize("k", [128, 80])
@pytest.mark.parametrize("block_k,split_k", [(16, 1), (32, 2), (16, 4), (32, 8)])
def test_split_k_and_ragged_k(dtype, k, block_k, split_k) -> None:
    """K = 80 with 32-wide tiles ends in a partial tile; a split larger than K's tiles drops programs."""
    x = randn(5, k, dtype=dtype, seed=1)
    weight = randn(56, k, dtype=dtype, seed=2)
    bias = randn(56, dtype=dtype, seed=3)
    config = LinearConfig(block_k=block_k, split_k=split_k, num_stages=2)
    assert_close_to_reference(linear(x, weight, bias, config), x, weight, bias)


def test_default_config_splits_k_only_for_few_column_tiles() -> None:
    # Qwen3-0.6B: qkv [4096, 1024], o [1024, 2048], gate_up [6144, 1024], down [1024, 3072]
    splits = {(n, k): ops.default_config(n, k, torch.bfloat16).split_k for n, k in
              [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (16, 64)]}  # fmt: skip
    assert splits == {(4096, 1024): 1, (1024, 2048): 4, (6144, 1024): 1, (1024, 3072): 4, (16, 64): 1}


def test_strided_rows_and_a_lone_row() -> None:
    """Rows 200 apart; one row of stride 200; one row of stride 1 (torch's strides of a size-1 dim)."""
    buffer = randn(4, 200, dtype=torch.float32, seed=4)
    weight = randn(24, 64, dtype=torch.float32, seed=5)
    for x in (buffer[:, 8:72], buffer[2:3, :64], buffer.view(-1)[:64].view(64, 1).t()):
        assert_close_to_reference(linear(x, weight), x, weight, None)


def test_no_rows() -> None:
    out = linear(torch.empty(0, 32), randn(8, 32, dtype=torch.float32, seed=6))
    assert out.shape == (0, 8)


def test_bad_inputs_raise_clear_errors() -> None:
    x = randn(2, 32, dtype=torch.float16, seed=7)
    weight = randn(8, 32, dtype=torch.float16, seed=8)
    cases = [
        (dict(x=x[None]), r"x \[M, K\] and weight \[N, K\]"),
        (dict(weight=weight[:, :16]), r"x \[M, K\] and weight \[N, K\]"),
        (dict(x=randn(MAX_ROWS + 1, 32, dtype=torch.float16, seed=9)), f"at most {MAX_ROWS}"),
        (dict(x=x.float()), "must share one of"),
        (dict(x=x.double(), weight=weight.double()), "must share one of"),
        (dict(x=randn(32, 2, dtype=torch.float16, seed=10).t()), "contiguous last dimension"),
        (dict(weight=randn(32, 8, dtype=torch.float16, seed=11).t()), "weight must be contiguous"),
        (dict(bias=torch.zeros(9, dtype=torch.float16)), r"bias must be a contiguous \[8\]"),
        (dict(bias=torch.zeros(8)), r"bias must be a contiguous \[8\] torch.float16"),
        (dict(bias=torch.zeros(16, dtype=torch.float16)[::2]), "bias must be a contiguous"),
        (dict(x=x[:, :0], weight=weight[:, :0]), "K >= 1"),
    ]
    for override, message in cases:
        args = dict(x=x, weight=weight, bias=None) | override
        with pytest.raises(ValueError, match=message):
            linear(args["x"], args["weight"], args["bias"])
    with pytest.raises(ValueError, match="powers of two"):
        linear(x, weight, config=LinearConfig(block_k=48))
    with pytest.raises(ValueError, match="powers of two"):
        linear(x, weight, config=LinearConfig(block_k=32, split_k=3))


def test_predicate() -> None:
    weight = randn(8, 32, dtype=torch.float16, seed=12)

    def rows(m: int, k: int = 32, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        return randn(m, k, dtype=dtype, seed=m)

    with fused_ops_mode("auto"):
        assert not use_small_m_kernel(rows(1), weight)  # CPU tensors: torch unless forced
    with fused_ops_mode("0"):
        assert not use_small_m_kernel(rows(1), weight)
    with fused_ops_mode("1"):
        assert all(use_small_m_kernel(rows(m), weight) for m in range(1, MAX_ROWS + 1))
        assert not use_small_m_kernel(rows(0), weight)
        assert not use_small_m_kernel(rows(MAX_ROWS + 1), weight)
        assert not use_small_m_kernel(rows(2)[None], weight)  # 3-D
        assert not use_small_m_kernel(rows(2, 24), randn(8, 24, dtype=torch.float16, seed=13))  # K % 16
        assert not use_small_m_kernel(rows(2, dtype=torch.float32), weight)
        assert not use_small_m_kernel(rows(2, dtype=torch.float64), weight.double())
        assert not use_small_m_kernel(rows(2), randn(32, 8, dtype=torch.float16, seed=14).t())
        assert not use_small_m_kernel(rows(32, 2).t(), weight)  # strided last dimension
        # Wide outputs (as many column tiles as TARGET_PROGRAMS) stay with cuBLAS.
        narrow = torch.empty((TARGET_PROGRAMS - 1) * BLOCK_N, 32, dtype=torch.float16)
        wide = torch.empty(TARGET_PROGRAMS * BLOCK_N, 32, dtype=torch.float16)
        assert use_small_m_kernel(rows(2), narrow) and not use_small_m_kernel(rows(2), wide)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(kernel, rows) of each call of the GEMV and small-M wrappers (the layer imports them at call
    time, so this sees them)."""
    import kvllm.layers.ops.gemv as gemv_ops

    calls: list[tuple[str, int]] = []

    def spy(name, real):  # noqa: ANN001, ANN202
        def wrapper(x, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            calls.append((name, x.shape[0]))
            return real(x, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(ops, "linear", spy("small_m", ops.linear))
    monkeypatch.setattr(gemv_ops, "gemv", spy("gemv", gemv_ops.gemv))
    return calls


def test_layers_dispatch(kernel_calls: list[tuple[str, int]]) -> None:
    torch.manual_seed(0)
    layers = [Linear(64, 48, bias=True), MergedLinear(64, [32, 16]), QKVLinear(64, 16, 2, 1, bias=True)]
    for layer in layers:
        for parameter in layer.parameters():
            parameter.data.normal_()
    for layer in layers:
        # Every layer here has a narrow output (48 columns): GEMV up to 4 rows, then the small-M kernel.
        for shape, mode, kernel in [
            ((1, 64), "1", "gemv"),
            ((3, 64), "1", "gemv"),
            ((5, 64), "1", "small_m"),
            ((MAX_ROWS, 64), "1", "small_m"),
            ((MAX_ROWS + 1, 64), "1", None),
            ((2, 3, 64), "1", None),  # 3-D: F.linear (the models pass [T, hidden])
            ((3, 64), "auto", None),  # CPU
            ((3, 64), "0", None),
        ]:
            kernel_calls.clear()
            x = torch.randn(shape)
            with fused_ops_mode(mode), torch.no_grad():
                out = layer(x)
            assert kernel_calls == ([(kernel, shape[0])] if kernel else []), (
                type(layer).__name__,
                shape,
                mode,
            )
            ref = F.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_wide_outputs_take_the_gemv_for_one_row_only(kernel_calls: list[tuple[str, int]]) -> None:
    wide = Linear(32, TARGET_PROGRAMS * BLOCK_N, bias=False)
    for rows, kernel in [(1, "gemv"), (2, None), (4, None)]:
        kernel_calls.clear()
        x = torch.randn(rows, 32)
        with fused_ops_mode("1"), torch.no_grad():
            out = wide(x)
        assert kernel_calls == ([(kernel, rows)] if kernel else []), rows
        torch.testing.assert_close(out, F.linear(x, wide.weight), rtol=1e-5, atol=1e-5)
