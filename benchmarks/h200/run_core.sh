#!/usr/bin/env bash
# GPU checks for the engine and our own kernels, on the H200 in one device call each:
#   bash benchmarks/h200/run_core.sh tests       # Triton/Flex kernel tests, engine bf16 greedy vs HF per backend
#   bash benchmarks/h200/run_core.sh attention   # kvllm.benchmarks.attention, peers side by side
# FlashAttention-4 is used when /tmp/site holds it (see ../shared/gpu/stage-flash-attn-4.sh).
# Logs, JUnit XML and JSON go to $OUT; a short summary is printed last.
set -uo pipefail
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
[ -d /tmp/site/flash_attn ] && export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
export PYTHONUNBUFFERED=1 KVLLM_GPU_REPORT_DIR=$out
budget=${BUDGET_S:-560}
{ nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  python3 -c "import flash_attn.cute; print('flash_attn.cute importable')" 2>&1 | tail -1
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
case "${1:?usage: run_core.sh tests|attention}" in
tests)
  timeout "$budget" python3 -m pytest -q -m gpu -rfEs -p no:cacheprovider --junitxml="$out/core-junit.xml" \
    ${TESTS:-tests/gpu/test_triton_attention_gpu.py tests/gpu/test_engine_cuda.py tests/gpu/test_flex_attention_gpu.py} \
    > "$out/core-tests.log" 2>&1
  rc=$?; tail -n 40 "$out/core-tests.log"; exit $rc ;;
attention)
  timeout "$budget" python3 -m kvllm.benchmarks.attention --output-json "$out/attention.json" ${ARGS:-} \
    > "$out/attention.log" 2>&1
  rc=$?; tail -n 60 "$out/attention.log"; exit $rc ;;
esac
