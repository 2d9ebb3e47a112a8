"""Programmatic dependent launch (kvllm/utils/pdl.py): when it is on, and what each kernel does
before its wait.

The rule that keeps PDL correct is about instruction order, so it is checked on the PTX that Triton
generates for SM 9.0 (this CPU machine compiles for it without a GPU): before `griddepcontrol.wait`
a kernel may load only its weights (the GEMV with `constant_weight`, RMSNorm's weight) and may store
nothing; after the wait comes `griddepcontrol.launch_dependents`. Run in a fresh interpreter without
TRITON_INTERPRET, where the decorators build real JITFunctions.
"""

from __future__ import annotations

import pytest
import torch

from kvllm.utils import pdl
from tests.offline_compile import run_compile_script

SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvllm.attention.ops.triton_unified_attention import _reduce_segments_kernel, _unified_attention_kernel
from kvllm.layers.ops.gemv import _gemv_kernel
from kvllm.layers.ops.rms_norm import _rms_norm_kernel
from kvllm.layers.ops.rotary import _qk_norm_rope_kernel

INT_POINTERS = ("block_table", "seq_lens", "query_start", "decode_order", "slot_mapping", "positions")
FLOAT_POINTERS = ("scale_ptr", "part_", "cos_sin", "sinks")
FLOAT_SCALARS = ("scale", "soft_cap", "eps")


def order(kernel, constexprs, num_warps=4):
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            kind = "i32" if name.startswith(INT_POINTERS) else "fp32" if name.startswith(FLOAT_POINTERS) or "scale" in name else "bf16"
            signature[name] = "*" + kind
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "launch_pdl": True}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    events = []
    for line in ptx.splitlines():
        if "griddepcontrol.wait" in line:
            events.append("wait")
        elif "griddepcontrol.launch_dependents" in line:
            events.append("launch")
        elif "ld.global" in line:
            events.append("load")
        elif "st.global" in line:
            events.append("store")
    wait = events.index("wait")
    return {
        "loads_before": events[:wait].count("load"),
        "stores_before": events[:wait].count("store"),
        "launch_after_wait": events[wait + 1] == "launch",
        "loads_after": events[wait:].count("load"),
    }


gemv = dict(BLOCK_M=1, BLOCK_N=2, BLOCK_K=1024, EVEN_K=True, SINGLE_TILE=True, HAS_BIAS=True, GATED=True,
            USE_PDL=True, INTERPRET=False)
attention = dict(QUERIES_PER_KV=2, HEAD_SIZE=128, HEAD_SIZE_PAD=128, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=1,
                 TILE_N=64, DECODE_ONLY=True, SPLIT=True, ORDERED=True, USE_SINKS=False, USE_SOFT_CAP=False, USE_WINDOW=False,
                 IS_FP8=False, FP8_DOT=0, DOT_PRECISION="tf32", USE_PDL=True)
rope = dict(NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_SIZE=128, ROT_HALF=64, ROT_HALF_PAD=64, PASS_SIZE=0, PASS_PAD=1,
            HEADS_PER_PROGRAM=16, HAS_QK_NORM=True, WRITE_KV=True, BLOCK_SIZE=16, IS_FP8=False,
            FP8_MANTISSA_BITS=3, FP8_MIN_EXPONENT=-6, FP8_ROUND_BY_HAND=False, USE_PDL=True, INTERPRET=False)
print(json.dumps({
    "gemv_prefetch": order(_gemv_kernel, {**gemv, "PREFETCH_W": True}, num_warps=1),
    "gemv_no_prefetch": order(_gemv_kernel, {**gemv, "PREFETCH_W": False}, num_warps=1),
    "gemv_long_k": order(_gemv_kernel, {**gemv, "BLOCK_K": 256, "EVEN_K": False, "SINGLE_TILE": False,
                                        "PREFETCH_W": True}, num_warps=1),
    "rms_norm": order(_rms_norm_kernel, dict(HIDDEN_SIZE=1024, BLOCK=1024, HAS_RESIDUAL=True, USE_PDL=True,
                                             INTERPRET=False)),
    "rope_kv_write": order(_qk_norm_rope_kernel, rope),
    "attention": order(_unified_attention_kernel, attention, num_warps=2),
    "reduce": order(_reduce_segments_kernel, dict(HEAD_SIZE=128, HEAD_SIZE_PAD=128, SEGMENTS_PAD=64, USE_PDL=True)),
}))
"""


@pytest.fixture(scope="module")
def orders() -> dict[str, dict]:
    return run_compile_script(SCRIPT)


def test_no_kernel_stores_before_its_wait_and_each_signals_right_after(orders):
    for name, order in orders.items():
        assert order["stores_before"] == 0, name
        assert order["launch_after_wait"], name
        assert order["loads_after"] > 0, name


def test_only_weights_load_before_the_wait(orders):
    # The GEMV of a layer's weight streams it while the previous kernel finishes ...
    assert orders["gemv_prefetch"]["loads_before"] > 0
    assert orders["rms_norm"]["loads_before"] > 0
    # ... and nothing else reads memory before the previous kernel is done.
    for name in ("gemv_no_prefetch", "gemv_long_k", "rope_kv_write", "attention", "reduce"):
        assert orders[name]["loads_before"] == 0, name


def test_off_on_the_cpu_under_the_interpreter_and_by_environment(monkeypatch):
    assert not pdl.pdl_enabled(torch.zeros(1))
    assert pdl.pdl_launch_options(False) == {}
    assert pdl.pdl_launch_options(True) == {"launch_pdl": True}
    monkeypatch.setenv("KVLLM_PDL", "0")
    pdl._device_has_pdl.cache_clear()
    try:
        # No CUDA device here: the environment switch is read before the capability.
        assert pdl._device_has_pdl(0) is False
    finally:
        pdl._device_has_pdl.cache_clear()
