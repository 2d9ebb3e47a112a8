#!/usr/bin/env bash
# The GPU calls of the thirtieth session, each sent within 30 s of the last one's return. A call naming
# nvidia-h200 gets an H100 or an H200, and the card is known only once it runs, so the first call picks its
# work by the card:
#   first    carry [".stage1", ".fi", ".so-lite", ".ab"], any card: on an H200 only the staging's first half and
#            FlashInfer unpacked (seconds; then `quiet`, carry [".stage2"], within 30 s: issue 23's one-run table);
#            on an H100 (where issue 23 ran in the twenty-sixth session) the h100 phase
#   so-ab    carry [".so-lite", ".ab"], any card: issue 19's batch-64 bench alternating the decode order sorted on
#            the device (before) and on the host; .ab/triton_attn_impl_before.py is main's file before the change:
#            mkdir -p .ab && git show bd43b61~1:kvllm/attention/backends/triton_attn_impl.py > .ab/triton_attn_impl_before.py
#            (.ab listed in .git/info/exclude)
#   h100     carry [".so-lite", ".ab"] (about 5 minutes): the GPU tests of the decode order sorted on the host (the
#            TRITON_ATTN kernel's, and graphs against eager), then so-ab with six arms (before after before after
#            after before)
#   decode-rows  carry nothing, meant for an H200: issue 23's two missed decode rows with both timings, and the
#            greedy and FLEX decode GPU tests the thirtieth session's quiet call ran out of time for
#   *        = session29.sh's phases
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session30.sh first|h100|decode-rows|so-ab|rows|h200|gemm|mma|flex-blocks|confirm|quiet|fi-walk|so}
default_budget_s=${DEFAULT_BUDGET_S:-420}

h100_work() {  # the decode order's GPU tests, then the structured-outputs A/B (six arms)
  parallel_tests 150 "attn|tests/gpu/test_triton_attention_gpu.py tests/gpu/test_host_copy_gpu.py" \
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
decode-rows)  # carry nothing, H200 (about 3 minutes): issue 23's two decode rows the H200 table missed, timed
  # both ways (bench: one call after an L2 flush, the host's launch gap included when it outlasts the flush;
  # queued: the device's own rate), then the steps of backends_session.sh that the thirtieth session's budget cut
  source benchmarks/h200/session_lib.sh
  decode_rows bench queued bench queued
  parallel_tests 110 "greedy|tests/gpu/test_engine_cuda.py -k 'not FLASHINFER and not FLASH_ATTN'" \
    "flex|tests/gpu/test_flex_attention_gpu.py -k 'decode_only or fresh or compile_count'"
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
