#!/usr/bin/env bash
# The GPU calls of the thirty-third session, each sent within 30 s of the last one's return.
#   first  carry [".stage1", ".fi"], BUDGET_S=200, any card: FA4's first half and FlashInfer unpacked (for `quiet`),
#          then FLEX_ATTENTION's decode graph hooks (written in the thirty-third session, declared `never` until this
#          passes) on a GPU for the first time: the graphs-against-eager test, both runs judged against HF float32
#   unpack carry [".stage1", ".fi"]: first without its test (when the test ran on another machine)
#   flex-e2e  carry nothing, BUDGET_S=330: the engine's FLEX_ATTENTION decode over 1k-token contexts at batch 64
#          and 256 (fast_path_bench latency-long), with its decode graphs and with --enforce-eager
#   h100   carry nothing, BUDGET_S=540, for an H100 (where issue 23's table does not count): first's test, then
#          flex-e2e
#   quiet  = session30.sh quiet (carry [".stage2"], ATTN_TIMING=graph, on an H200): issue 23's one-run table,
#          auto-tune, the FLASH_ATTN walk, the bf16 greedy test (FLEX_ATTENTION now graphed) and FLEX's GPU tests
#   *      = session32.sh's phases
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session33.sh first|unpack|flex-e2e|h100|quiet|<session32.sh phase>}
default_budget_s=${DEFAULT_BUDGET_S:-420}

case "$phase" in
first|unpack)
  source benchmarks/h200/session_lib.sh
  run_step stage1 60 bash .stage1/unpack.sh
  run_step fi-unpack 60 bash .fi/unpack.sh
  [ "$phase" = unpack ] && { end_phase; exit 0; }
  parallel_tests 170 "graphs|tests/gpu/test_cuda_graphs_gpu.py -k FLEX_ATTENTION"
  end_phase
  ;;
flex-e2e|h100)
  source benchmarks/h200/session_lib.sh
  [ "$phase" = h100 ] && parallel_tests 170 "graphs|tests/gpu/test_cuda_graphs_gpu.py -k FLEX_ATTENTION"
  for mode in graphs eager; do
    # FLEX declares no graphs until the GPU test has passed: the graphs arm assumes them (its label says so)
    extra=(--assume-graph-support); [ $mode = eager ] && extra=(--enforce-eager)
    bench "flex-$mode" 150 --engine kvllm --backend FLEX_ATTENTION "${extra[@]}" --only latency-long --iters 2 \
      --warmups 1
  done
  end_phase
  ;;
*)
  exec bash benchmarks/h200/session32.sh "$phase" ;;
esac
