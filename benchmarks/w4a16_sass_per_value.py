"""SASS instructions per weight value in the K loop of the W4A16 GEMMs, compiled offline for SM 9.0 (no GPU):
the Triton GEMM (w4a16.py, the route for 5-64 rows before the tensor-core GEMM) and the tensor-core GEMM
(w4a16_gemm_mma.py) at a few tiles; with the loop's spills (LDL/STL), shared-memory stores (STS) and MMAs.

    .venv/bin/python benchmarks/w4a16_sass_per_value.py [--output-json FILE]

Per value = the loop body's instructions x 32 x warps / (block_n x 128 values): each warp issues the whole
body once per tile. The loop body is the longest backward branch of the SASS (tests/kernels/
test_w4a16_gemv_sm90.py's `loop_body`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kernels.test_w4a16_gemv_sm90 import COMMON  # noqa: E402
from tests.offline_compile import run_compile_script  # noqa: E402

SCRIPT = (
    COMMON
    + r"""
from kvllm.layers.quantization.ops.w4a16 import _w4a16_kernel as triton_gemm
from kvllm.layers.quantization.ops.w4a16_gemm_mma import _w4a16_gemm_mma_kernel as mma_gemm

def facts(kernel, constexprs, block_n, warps, stages):
    ops = loop_body(sass_of(build(kernel, constexprs, stages, warps)))
    return {"per_value": round(sum(ops.values()) * 32 * warps / (block_n * 128), 2),
            **{op: ops.get(op, 0) for op in ("LDL", "STL", "STS", "HGMMA", "HMMA")}}

def old(block_m, block_n, warps, stages):
    return facts(triton_gemm, dict(GROUP_SIZE=128, BW=16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, SPLIT_K=1,
                                   PARTIAL_ROWS=block_m, HAS_BIAS=False, GATHER=False, INTERPRET=False),
                 block_n, warps, stages)

def new(block_m, block_n, warps, stages, one_dot=False):
    return facts(mma_gemm, dict(GROUP_SIZE=128, BLOCK_M=block_m, BLOCK_N=block_n, EVEN_N=True, HAS_BIAS=False,
                                SPLIT_K=1, PARTIAL_ROWS=1, ONE_DOT=one_dot, NUM_STAGES=stages, INTERPRET=False),
                 block_n, warps, stages)

print(json.dumps({
    "triton_gemm 64x128 (4 warps, 3 stages)": old(64, 128, 4, 3),
    "mma_gemm 16x128 (4 warps, 4 stages)": new(16, 128, 4, 4),
    "mma_gemm 64x128 (4 warps, 4 stages)": new(64, 128, 4, 4),
    "mma_gemm 128x128 (4 warps, 3 stages)": new(128, 128, 4, 3),
    "mma_gemm 128x256 (8 warps, 3 stages)": new(128, 256, 8, 3),
    "mma_gemm 128x256 one_dot (8 warps, 3 stages)": new(128, 256, 8, 3, one_dot=True),
}))
"""
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    result = run_compile_script(SCRIPT)
    for name, facts in result.items():
        print(f"{name:48s} {facts}")
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
