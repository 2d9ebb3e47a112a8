#!/usr/bin/env bash
# The GPU calls of the thirty-first session. A call naming nvidia-h200 gets an H100 or an H200, and the card
# is known only once it runs, so `first` picks its work by the card:
#   first  carry [".so-lite", ".ab"], BUDGET_S=560 (about 6 minutes on an H200):
#          on an H200: issue 23's two missed decode rows timed three ways, twice (bench, queued, graph:
#          session30.sh decode-rows plus --timing graph), then the GPU tests the thirtieth session's budget cut
#          (bf16 greedy, FLEX decode) and those of the decode order sorted on the host (TRITON_ATTN's kernel,
#          graphs against eager); then send `quant` (carry .so-lite) within 30 s;
#          on an H100: session30.sh h100 (the decode order's GPU tests and its structured-outputs A/B)
#   quant  carry [".so-lite"] (optional), BUDGET_S=540, meant for the H200 (about 8 minutes): issue 22's one-row
#          GEMV sweep (`--set h200`) first, then AWQ (with the sweep's table) and bf16 end to end, then, with
#          .so-lite, issue 19's batch-64 structured-outputs bench three times
#   *      = session30.sh's phases
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session31.sh first|quant|<session30.sh phase>}
default_budget_s=${DEFAULT_BUDGET_S:-420}

case "$phase" in
first)
  source benchmarks/h200/session_lib.sh
  if ! on_h200; then
    end_phase
    exec env BUDGET_S=$(( end - $(date +%s) )) bash benchmarks/h200/session30.sh h100
  fi
  decode_rows bench queued graph bench queued graph
  parallel_tests 150 "greedy|tests/gpu/test_engine_cuda.py -k 'not FLASHINFER and not FLASH_ATTN'" \
    "flex|tests/gpu/test_flex_attention_gpu.py -k 'decode_only or fresh or compile_count'" \
    "attn|tests/gpu/test_triton_attention_gpu.py tests/gpu/test_host_copy_gpu.py" \
    "graphs|tests/gpu/test_cuda_graphs_gpu.py -k TRITON_ATTN"
  end_phase
  ;;
quant)
  source benchmarks/h200/session_lib.sh
  gemv_sweep_and_e2e
  so_runs 3
  end_phase
  ;;
*)
  exec bash benchmarks/h200/session30.sh "$phase" ;;
esac
