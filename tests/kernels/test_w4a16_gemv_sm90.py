"""The W4A16 GEMV as compiled for SM 9.0 (this CPU machine compiles for it without a GPU): the
structure its speed rests on (kvllm/layers/quantization/ops/w4a16_gemv.py's docstring), checked in
the PTX and the SASS so that a change that loses it fails here rather than only on an H200.

- The K loop is software-pipelined: its weight tiles are copied with cp.async (shared memory), not
  loaded into registers in the iteration that decodes them.
- The weight rows' L2 prefetch and nothing else that reads memory come before `griddepcontrol.wait`.
- The loop body has no layout conversion through shared memory besides the pipeline's, no local
  memory (spills), and at most 3.5 SASS instructions per weight value at one row (8 columns, one
  warp: 3.2 as written; the FMA and the nibble's mask are 2 of them).

Run in a fresh interpreter without TRITON_INTERPRET, where the decorators build real JITFunctions.
"""

from __future__ import annotations

import pytest

from tests.offline_compile import run_compile_script

COMMON = r"""
import json, os, re, subprocess, tempfile
from collections import Counter
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

POINTERS = {"qw_ptr": "*i32", "ticket_ptr": "*i32", "ws_ptr": "*fp32", "partial_ptr": "*fp32"}

def build(kernel, constexprs, stages, warps=1, activations="*bf16"):
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = POINTERS.get(name, activations)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name in ("N", "K", "stride_wn", "stride_xm", "stride_om"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})

def sass_of(c):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    return sass

def loop_body(sass):
    lines = sass.splitlines()
    labels = {l.strip()[:-1]: j for j, l in enumerate(lines) if re.match(r"\s*\.L_x_\d+:", l)}
    body = []
    for i, l in enumerate(lines):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", l)
        if m and labels.get(m.group(1), 1 << 30) < i and i - labels[m.group(1)] > len(body):
            body = lines[labels[m.group(1)]:i + 1]
    ops = Counter()
    for l in body:
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", l)
        if m:
            ops[re.sub(r"^@!?U?P\w+\s+", "", m.group(1)).split()[0].split(".")[0]] += 1
    return ops
"""

SCRIPT = (
    COMMON
    + r"""
from kvllm.layers.quantization.ops.w4a16_gemv import _w4a16_gemv_kernel as kernel

def facts(block_n, gated, stages, split_k=1, flat=False):
    c = build(kernel, dict(SPLIT_K=split_k, GROUP_SIZE=128, BW=16, BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=1024,
                           PER_NIBBLE=False, EVEN_N=True, EVEN_K=True, HAS_BIAS=False, GATED=gated, PAIRED=False,
                           FLAT_TILE=flat, USE_PDL=True, PREFETCH=True, PREFETCH_GROUPS=True, NUM_STAGES=stages,
                           INTERPRET=False), stages)
    ptx = c.asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    ops = loop_body(sass_of(c))
    values_per_thread = block_n * 1024 * (2 if gated else 1) // 32
    return {
        "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
        "cp_async_16_bytes": ptx.count("cp.async.cg"),  # .cg copies 16 bytes; the weights' tiles take it
        "shared_orders": re.findall(r"#shared\d* = #ttg.swizzled_shared<\{[^}]*order = \[([0-9, ]+)\]", c.asm["ttgir"]),
        "before_wait": [op for op in ("ld.global", "cp.async.cg", "cp.async.ca", "cp.async.bulk.prefetch", "st.global")
                        if op in ptx[:wait]],
        "loop_ops": dict(ops),
        "per_value": sum(ops.values()) / values_per_thread,
    }

print(json.dumps({"gemv": facts(8, False, 3), "gated": facts(4, True, 3), "split": facts(8, False, 3, split_k=2),
                  "flat": facts(4, False, 3, flat=True)}))
"""
)


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    return run_compile_script(SCRIPT)


@pytest.mark.parametrize("kind", ["gemv", "gated", "split", "flat"])
def test_loop_is_pipelined_with_cp_async(compiled, kind) -> None:
    facts = compiled[kind]
    assert facts["cp_async"] > 0
    assert facts["loop_ops"].get("LDGSTS", 0) > 0  # the copies are issued in the loop, for later tiles


@pytest.mark.parametrize("kind", ["gemv", "gated", "split", "flat"])
def test_weight_tiles_copy_16_bytes_at_a_time(compiled, kind) -> None:
    """The split's K offset once cost the weights their 16-byte alignment (8-byte copies, twice the
    instructions) for every config, split or not; multiple_of keeps it."""
    assert compiled[kind]["cp_async_16_bytes"] > 0


def test_flat_tile_copies_into_row_major_shared_memory(compiled) -> None:
    """Triton orders the 4-D tile's shared copy otherwise than row-major ([3, 0, 2, 1] at 8 columns,
    [3, 1, 0, 2] at 4: bank conflicts on an H100, ncu); the flat tile's copy is row-major."""
    four_d = [order for order in compiled["gemv"]["shared_orders"] if order.count(",") == 3]
    assert four_d and "3, 2, 1, 0" not in four_d[:1], compiled["gemv"]["shared_orders"]
    assert "1, 0" in compiled["flat"]["shared_orders"], compiled["flat"]["shared_orders"]


@pytest.mark.parametrize("kind", ["gemv", "gated"])
def test_only_the_weight_prefetch_precedes_the_pdl_wait(compiled, kind) -> None:
    assert compiled[kind]["before_wait"] == ["cp.async.bulk.prefetch"]


@pytest.mark.parametrize("kind", ["gemv", "gated"])
def test_loop_has_no_spills_no_conversions_and_few_instructions_per_value(compiled, kind) -> None:
    ops = compiled[kind]["loop_ops"]
    assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0, ops
    assert ops.get("STS", 0) == 0 and ops.get("SHFL", 0) == 0, ops  # no register-layout conversion
    assert compiled[kind]["per_value"] <= 3.5, (compiled[kind]["per_value"], ops)


MMA_SCRIPT = (
    COMMON
    + r"""
from kvllm.layers.quantization.ops.w4a16_gemv_mma import _w4a16_gemv_mma_kernel as kernel

def loop_ops(block_n, rows, gated, split):
    c = build(kernel, dict(GROUP_SIZE=128, BLOCK_M=rows, BLOCK_N=block_n, BLOCK_K=128, EVEN_N=True, HAS_BIAS=False,
                           GATED=gated, SPLIT_K=split, NUM_STAGES=4, INTERPRET=False), 4)
    ops = loop_body(sass_of(c))
    return {"loop_ops": dict(ops), "per_value": sum(ops.values()) / (block_n * 128 * (2 if gated else 1) / 32)}

print(json.dumps({"one_row": loop_ops(64, 1, False, 1), "four_rows": loop_ops(64, 4, False, 1),
                  "gated": loop_ops(32, 1, True, 1), "split": loop_ops(64, 1, False, 2)}))
"""
)


@pytest.fixture(scope="module")
def compiled_mma() -> dict[str, dict]:
    return run_compile_script(MMA_SCRIPT)


@pytest.mark.parametrize("kind", ["one_row", "four_rows", "gated", "split"])
def test_mma_gemv_decodes_pairs_into_tensor_cores_at_under_two_instructions_a_value(
    compiled_mma, kind
) -> None:
    """The tensor-core GEMV's loop (w4a16_gemv_mma.py's docstring): pipelined tile copies, HMMAs, a
    shift and a lop3 per pair of values with no int-to-float conversion, no spills, and under 2 SASS
    instructions per weight value at 64 columns per warp (1.79 at one row as written; gated at 32, two
    streams: 64 at one warp spill)."""
    facts = compiled_mma[kind]
    ops = facts["loop_ops"]
    assert ops.get("LDGSTS", 0) > 0 and ops.get("HMMA", 0) > 0, ops
    assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0, ops
    assert not any(op in ops for op in ("I2F", "F2F", "I2FP", "F2FP")), ops
    assert facts["per_value"] < 2.0, (facts["per_value"], ops)
