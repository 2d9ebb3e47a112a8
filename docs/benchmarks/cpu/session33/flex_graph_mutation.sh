#!/usr/bin/env bash
# The CPU tests of FLEX_ATTENTION's decode graphs with the mask-update rule taken out: both must fail.
# Run in a scratch clone (it edits the source), from its root, with its .venv.
set -uo pipefail
sed -i 's/if mask_key not in meta.masks or (meta.for_graph and meta.mask_owners\[mask_key\] is self):/if mask_key not in meta.masks:/' \
  kvllm/attention/backends/flex_attention_impl.py
git diff --stat
.venv/bin/python -m pytest -q -p no:cacheprovider \
  "tests/unit/test_cuda_graph_runner.py::test_engine_with_graphs_replayed_eagerly_matches_hf[FLEX_ATTENTION+decode_path]" \
  tests/kernels/test_flex_attention_split.py -k "decode_path or follows_each" 2>&1 | grep -E "^E  |passed|failed"
git checkout -- kvllm/attention/backends/flex_attention_impl.py
