#!/usr/bin/env bash
# The GPU calls of the thirtieth session, each sent within 30 s of the last one's return. A call naming
# nvidia-h200 gets an H100 or an H200, and the card is known only once it runs, so the first call picks its
# work by the card:
#   first    carry [".stage1", ".fi"], any card: on an H200 only the staging's first half and FlashInfer unpacked
#            (seconds; then `quiet`, carry [".stage2"], within 30 s: issue 23's one-run table); on an H100 (where
#            issue 23 ran in the twenty-sixth session) the GPU tests of the decode order sorted on the host (the
#            TRITON_ATTN kernel's, and graphs against eager), then the one-row W4A16 GEMV sweep `--set h200`
#            (deeper CUDA-core pipelines beside the shipped H100 table and the tensor-core leaders)
#   so-ab    carry [".so-lite"] (.ab/triton_attn_impl_before.py travels untracked), any card: issue 19's batch-64
#            bench alternating the decode order sorted on the device (before) and on the host (after)
#   h100     carry [".so-lite"], meant for a call naming nvidia-h100-x1: first's H100 tests, then so-ab with six
#            arms (before after before after after before)
#   *        = session29.sh's phases
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session30.sh first|h100|so-ab|rows|h200|gemm|mma|flex-blocks|confirm|quiet|fi-walk|so}
default_budget_s=${DEFAULT_BUDGET_S:-420}

case "$phase" in
first)
  source benchmarks/h200/session_lib.sh
  if on_h200; then
    run_step stage1 60 bash .stage1/unpack.sh
    run_step fi-unpack 60 bash .fi/unpack.sh
    since "on an H200: send quiet (carry .stage2) now"
    end_phase
    exit 0
  fi
  # The decode order now sorted on the host (issue 19's host time): its GPU tests, graphs against eager included.
  parallel_tests 150 "attn|tests/gpu/test_triton_attention_gpu.py" \
    "graphs|tests/gpu/test_cuda_graphs_gpu.py -k TRITON_ATTN"
  run_step gemv-sweep 150 python3 benchmarks/h200/w4a16_gemv_m1.py --out "$d" --set h200 --budget-s 110 \
    --table-out "$d/w4a16_gemv_configs.json"
  sed -n '/best per shape/,$p' "$d/gemv-sweep.log" | head -12
  end_phase
  ;;
h100)  # carry [".so-lite"]: the decode order's GPU tests, then so-ab's bench (about 5 minutes)
  source benchmarks/h200/session_lib.sh
  parallel_tests 150 "attn|tests/gpu/test_triton_attention_gpu.py" \
    "graphs|tests/gpu/test_cuda_graphs_gpu.py -k TRITON_ATTN"
  if stage_structured_outputs; then
    (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok
     SO_FILES=kvllm/attention/backends/triton_attn_impl.py so_ab before after before after after before)
  fi
  end_phase
  ;;
so-ab)  # issue 19's bench, the decode order sorted on the device (before) and on the host (after), alternating
  source benchmarks/h200/session_lib.sh
  if stage_structured_outputs; then
    (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok
     SO_FILES=kvllm/attention/backends/triton_attn_impl.py so_ab before after before after)
  fi
  end_phase
  ;;
*)
  exec bash benchmarks/h200/session29.sh "$phase" ;;
esac
