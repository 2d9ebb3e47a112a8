"""The tensor-core W4A16 GEMM as compiled for SM 9.0 (this CPU machine compiles for it without a GPU): the
structure its speed rests on (kvllm/layers/quantization/ops/w4a16_gemm_mma.py's docstring), checked in the
SASS so that a change that loses it fails here rather than only on a GPU.

- The K loop copies the weight words and the activations with cp.async (Triton's pipeline) and feeds
  warpgroup MMAs (HGMMA) with the weights as the register operand: the decoded tile never goes through
  shared memory (the old Triton GEMM stored all of it there, 136 STS a tile, and spilled); the only
  stores are the group factors' layout change (2), and there is no local memory.
- `one_dot` (the defaults' choice where the H100 sweep had it faster, e.g. up to 16 rows on qkv, o and
  gate_up) issues a tile's MMAs back to back at 8 warps, where four dots wait on each.
- The decode is packed 16-bit arithmetic: no int-to-float or float-to-float conversion, and about 3.4
  SASS instructions per weight value whatever the row tile (13.5 for the old GEMM at 64 x 128: benchmarks/w4a16_sass_per_value.py).
"""

from __future__ import annotations

import pytest

from tests.kernels.test_w4a16_gemv_sm90 import COMMON
from tests.offline_compile import run_compile_script

SCRIPT = (
    COMMON
    + r"""
from kvllm.layers.quantization.ops.w4a16_gemm_mma import _w4a16_gemm_mma_kernel as kernel

def facts(block_m, block_n, warps, stages, dtype, one_dot=False):
    constexprs = dict(GROUP_SIZE=128, BLOCK_M=block_m, BLOCK_N=block_n, EVEN_N=True, HAS_BIAS=False, SPLIT_K=1,
                      PARTIAL_ROWS=1, ONE_DOT=one_dot, NUM_STAGES=stages, INTERPRET=False)
    c = build(kernel, constexprs, stages, warps, dtype)
    ops = loop_body(sass_of(c))
    return {"loop_ops": dict(ops), "per_value": sum(ops.values()) * 32 * warps / (block_n * 128)}

print(json.dumps({"bf16_16_rows": facts(16, 128, 4, 4, "*bf16"), "fp16_128_rows": facts(128, 128, 4, 3, "*fp16"),
                  "one_dot_8_warps": facts(128, 256, 8, 3, "*bf16", one_dot=True),
                  "one_dot_16_rows": facts(16, 256, 8, 4, "*bf16", one_dot=True)}))
"""
)


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    return run_compile_script(SCRIPT)


@pytest.mark.parametrize("kind", ["bf16_16_rows", "fp16_128_rows", "one_dot_8_warps", "one_dot_16_rows"])
def test_mma_gemm_feeds_warpgroup_mmas_from_registers_at_under_four_instructions_a_value(
    compiled, kind
) -> None:
    facts = compiled[kind]
    ops = facts["loop_ops"]
    assert ops.get("LDGSTS", 0) > 0 and ops.get("HGMMA", 0) > 0, ops
    assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0 and ops.get("STS", 0) <= 2, ops
    assert not any(op in ops for op in ("I2F", "F2F", "I2FP", "F2FP")), ops
    assert ops.get("HMUL2", 0) > 0, ops  # the scale, packed
    assert facts["per_value"] < 3.6, (facts["per_value"], ops)


def test_mma_gemm_one_dot_issues_a_tiles_mmas_without_waiting_between_them(compiled) -> None:
    """`one_dot` (w4a16_gemm_mma.py's docstring): at 8 warps the tile's MMAs are not each waited on, at 128
    rows and in the 16-row default alike; four dots are (a wait after every HGMMA), which is what it is
    meant to remove."""
    kinds = ("one_dot_8_warps", "one_dot_16_rows", "bf16_16_rows")
    waits = {kind: compiled[kind]["loop_ops"].get("WARPGROUP", 0) for kind in kinds}
    hgmma = {kind: compiled[kind]["loop_ops"]["HGMMA"] for kind in kinds}
    assert waits["bf16_16_rows"] >= hgmma["bf16_16_rows"], (waits, hgmma)
    assert waits["one_dot_8_warps"] < hgmma["one_dot_8_warps"] / 2, (waits, hgmma)
    assert waits["one_dot_16_rows"] < hgmma["one_dot_16_rows"] / 2, (waits, hgmma)
