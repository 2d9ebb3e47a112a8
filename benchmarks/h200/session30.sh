#!/usr/bin/env bash
# The GPU calls of the thirtieth session, each sent within 30 s of the last one's return. A call naming
# nvidia-h200 gets an H100 or an H200, and the card is known only once it runs, so the first call picks its
# work by the card:
#   first    carry [".stage1", ".fi", ".so-lite", ".ab"], any card: on an H200 only the staging's first half and
#            FlashInfer unpacked (seconds; then `quiet`, carry [".stage2"], within 30 s: issue 23's one-run table);
#            on an H100 (where issue 23 ran in the twenty-sixth session) the h100 phase
#   so-ab    carry [".so-lite", ".ab"] (.ab/triton_attn_impl_before.py: main's file before bd43b61), any card:
#            issue 19's batch-64 bench alternating the decode order sorted on the device (before) and on the host
#   h100     carry [".so-lite", ".ab"] (about 5 minutes): the GPU tests of the decode order sorted on the host (the
#            TRITON_ATTN kernel's, and graphs against eager), then so-ab with six arms (before after before after
#            after before)
#   *        = session29.sh's phases
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session30.sh first|h100|so-ab|rows|h200|gemm|mma|flex-blocks|confirm|quiet|fi-walk|so}
default_budget_s=${DEFAULT_BUDGET_S:-420}

h100_work() {  # the decode order's GPU tests, then the structured-outputs A/B (six arms)
  parallel_tests 150 "attn|tests/gpu/test_triton_attention_gpu.py" \
    "graphs|tests/gpu/test_cuda_graphs_gpu.py -k TRITON_ATTN"
  if stage_structured_outputs; then
    (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok
     SO_FILES=kvllm/attention/backends/triton_attn_impl.py so_ab ${SO_AB_ARMS:-before after before after after before})
  fi
}

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
  h100_work
  end_phase
  ;;
h100)
  source benchmarks/h200/session_lib.sh
  h100_work
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
