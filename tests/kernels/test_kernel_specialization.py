"""Triton kernels are not specialized on arguments that change every step.

Triton compiles one variant per "== 1" / "multiple of 16" pattern of its integer arguments; for an
argument that follows the batch (how many requests, the block table's width, a per-step seed) that
means compiling kernels, seconds each, in the middle of serving. Checked in a fresh interpreter
without TRITON_INTERPRET, where the decorators build real JITFunctions.
"""

from __future__ import annotations

import json

from tests.offline_compile import run_compile_script

EXPECTED = {
    "kvllm.attention.ops.triton_unified_attention:_unified_attention_kernel": [
        "seq_lo",
        "seq_hi",
        "num_segments",
        "window",
        "stride_bt",
    ],
    "kvllm.attention.ops.triton_unified_attention:_reduce_segments_kernel": ["num_reqs", "num_segments"],
    "kvllm.attention.ops.triton_prefill_attention:_prefill_attention_kernel": [
        "seq_lo",
        "seq_hi",
        "window",
        "stride_bt",
    ],
    "kvllm.sample.gumbel:_gumbel_chunk_kernel": ["seed", "blocks_per_chunk", "num_chunks"],
    "kvllm.sample.gumbel:_reduce_chunks_kernel": ["num_chunks"],
    "kvllm.layers.ops.linear:_small_m_linear_kernel": ["M"],
    "kvllm.layers.ops.linear:_split_k_reduce_kernel": [],  # rows come from the grid
    "kvllm.layers.moe.fused_moe_triton:_fused_moe_kernel": ["num_valid_pairs"],
}

SCRIPT = """
import importlib, json, sys
out = {}
for key in json.loads(sys.argv[1]):
    module, name = key.split(":")
    kernel = getattr(importlib.import_module(module), name)
    params = [p.name for p in kernel.params]
    out[key] = {"dns": [params[i] if isinstance(i, int) else i for i in kernel.do_not_specialize], "params": params}
print(json.dumps(out))
"""


def test_per_step_arguments_are_not_specialized():
    found = run_compile_script(SCRIPT, json.dumps(list(EXPECTED)))
    for key, names in EXPECTED.items():
        assert set(names) <= set(found[key]["params"]), (key, found[key]["params"])  # the names still exist
        assert set(found[key]["dns"]) == set(names), (key, found[key]["dns"])
