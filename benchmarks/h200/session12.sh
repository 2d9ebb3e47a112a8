#!/usr/bin/env bash
# The twelfth session's H200 call, written in a session that had no device time left (175 s, under the 4 minutes
# a machine needs to start): the next lease runs it as one call, about 9 minutes (budget 570 s). Raw results go under
# /tmp/<phase>/ and are tarred into $OUT/<phase>.tgz after every step; a short table goes to stdout.
# Staging here first: bash benchmarks/h200/stage-structured-outputs.sh
#   main  carry [".so-bench"]:
#     - issue 19: structured outputs at batch 64 with the matchers on the engine's thread and in the grammar
#       process (--grammar-process), alternating twice (the host's speed drifts over a call), host clock on;
#       then tests/gpu/test_structured_outputs_gpu.py (the grammar process's masks page-locked in place, its
#       texts equal to the engine thread's).
#     - issue 23: FLEX_ATTENTION's split path timed beside its general path on the issue's two shapes
#       (decode 256 x 1k, prefill 8 x 2048), with torch's compiled FlexAttention and SDPA as peers.
# If the process's loss is lower in both pairs, make grammar_process the default on CUDA; if the split path
# is faster on both shapes, make it FLEX_ATTENTION's default on CUDA.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session12.sh main}
default_budget_s=570
source benchmarks/h200/session_lib.sh

case "$phase" in
main)
  tok=/tmp/so-tok
  if stage_structured_outputs; then
    (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=$tok
     for pair in 1 2; do
       for mode in engine process; do
         extra=(); [ $mode = process ] && extra=(--grammar-process)
         run_step "so-$mode-$pair" 70 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer "$tok" \
           --repeats 2 --host-clock "${extra[@]}" --out "$d/structured_outputs-$mode-$pair.json"
         tail -n 1 "$d/so-$mode-$pair.log"
       done
     done
     run_step so-tests-gpu 80 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
       tests/gpu/test_structured_outputs_gpu.py)
  else
    since "structured outputs: skipped (carry .so-bench)"
  fi
  for split in 0 1; do
    KVLLM_FLEX_SPLIT_PATH=$split run_step "flex-split$split" 80 python3 -m kvllm.benchmarks.attention \
      --backends FLEX_ATTENTION --peers flex,sdpa --only-shapes --shape "decode b256 x ctx1k:256x1@1023" \
      --shape "prefill 8x2048 causal:8x2048@0" --output-json "$d/flex-split$split.json"
    grep -E "FLEX_ATTENTION|flex|sdpa" "$d/flex-split$split.log" | grep -v skipped | head -n 6
  done
  ;;
esac
kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
save
since "done"
