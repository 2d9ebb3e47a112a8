"""How TRITON_ATTN's decode kernel reads an fp8 cache, checked on the PTX Triton generates for SM 9.0
(this CPU machine compiles for it without a GPU; a fresh interpreter without TRITON_INTERPRET).

With KVLLM_FP8_ATTENTION_DOT=fp16 Triton moves the fp8 -> fp16 cast after the tile's shared-memory
layout change and reads the fp8 tile from shared memory a byte at a time; fp16_registers keeps the
cast in registers, so the tile goes through shared memory as 16-bit values (vector stores, ldmatrix)
and no byte-wise shared load is left. The H200 times the two in docs/benchmarks.md.
"""

from __future__ import annotations

from tests.offline_compile import run_compile_script

SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvllm.attention.ops.triton_unified_attention import FP8_DOT_MODES, _unified_attention_kernel as kernel

constexprs = dict(QUERIES_PER_KV=2, HEAD_SIZE=128, HEAD_SIZE_PAD=128, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=1,
                  TILE_N=64, DECODE_ONLY=True, SPLIT=True, ORDERED=False, USE_SINKS=False, USE_SOFT_CAP=False,
                  USE_WINDOW=False, IS_FP8=True, FP8_DOT=FP8_DOT_MODES[sys.argv[1]], DOT_PRECISION="tf32",
                  USE_PDL=False)
signature, attrs = {}, {}
for i, name in enumerate(kernel.arg_names):
    if name in constexprs:
        signature[name] = "constexpr"
    elif name.endswith("_ptr"):
        if name.startswith(("block_table", "seq_lens", "query_start")):
            kind = "i32"
        elif name.startswith(("k_cache", "v_cache")):
            kind = "fp8e4nv"
        elif name.startswith(("part_", "sinks", "k_scale", "v_scale")):
            kind = "fp32"
        else:
            kind = "bf16"
        signature[name] = "*" + kind
        attrs[(i,)] = [["tt.divisibility", 16]]
    else:
        signature[name] = "fp32" if name in ("scale", "soft_cap") else "i32"
        if name.startswith("stride") and name != "stride_bt":
            attrs[(i,)] = [["tt.divisibility", 16]]
src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2, "num_stages": 2}).asm["ptx"]
count = lambda op: sum(line.split()[0] == op for line in ptx.splitlines() if line.strip())
print(json.dumps({op: count(op) for op in ("ld.shared.b8", "cvt.rn.f16x2.e4m3x2", "cvt.bf16.f16",
                                           "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                                           "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32")}))
"""


def _ptx_counts(mode: str) -> dict[str, int]:
    return run_compile_script(SCRIPT, mode)


def test_fp16_registers_keeps_the_cast_before_shared_memory() -> None:
    late, early = _ptx_counts("fp16"), _ptx_counts("fp16_registers")
    assert late["ld.shared.b8"] > 0  # what the mode is for: fp16's cast was moved past the layout change
    assert early["ld.shared.b8"] == 0
    assert early["ldmatrix.sync.aligned.m8n8.x4.shared.b16"] > 0
    for counts in (late, early):  # both: one exact conversion per pair of values, fp16 tensor cores
        assert counts["cvt.rn.f16x2.e4m3x2"] > 0 and counts["cvt.bf16.f16"] == 0
        assert counts["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"] > 0
