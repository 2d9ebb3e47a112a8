#!/usr/bin/env bash
# The twentieth session's GPU calls. The first call's card and carry decide the rest: on an H200 (none came in
# the fourteenth to twentieth sessions) with .vllm/part1 carried, vLLM 0.22 is staged over three calls on one
# warm machine (each sent within 30 s of the last one's return), then session17.sh c and d put kvllm beside it
# (issues 17 and 19).
# Raw results under /tmp/<phase>/, tarred into $OUT/<phase>.tgz after every step; a short table on stdout.
#   first   carry [".vllm/part1", ".so-lite", ".ab"]: on an H200, vLLM's first piece and issue 22's batch-1 AWQ
#           against bf16 with the decode GEMV under PDL and without (gemv_pdl_ab: the issue's ratio on its card).
#           Without .vllm/part1 on an H200: gemv_pdl_ab, then kvllm alone on issue 17's table (latency, nano-vllm
#           with its kernel timeline, 256 x 128/128), against the vLLM 0.22 numbers of earlier H200 leases.
#           On an H100, session19.sh next (gemv_pdl_ab, then the sampling files' A/A/B for issue 19's
#           unconstrained puzzle).
#   second  carry [".vllm/part2"] (H200, after first): vLLM's second piece, and FLEX_ATTENTION's rows (issue 23)
#           when SECOND_FLEX=1 (the session's device time is short: the default stages only).
#   then    session17.sh c with carry [".vllm/part3"] (issue 17's table beside vLLM, latency included), and
#           session17.sh d with carry [".so-lite"] if the device time allows.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session20.sh first|second}
default_budget_s=${DEFAULT_BUDGET_S:-560}
source benchmarks/h200/session_lib.sh

case "$phase" in
first)
  if on_h200 && [ -d .vllm/part1 ]; then
    run_step vllm-stage1 40 bash .vllm/part1/remote-stage.sh 1
    gemv_pdl_ab
  elif on_h200; then  # too little device time left for vLLM's three calls: kvllm alone on issue 17's table
    gemv_pdl_ab
    bench kvllm 150 --engine kvllm --backend TRITON_ATTN --only latency,nano,bs256 --iters 3 --warmups 2 \
      --profile-nano --out "$d/kvllm"
  else
    gemv_pdl_ab
    if (( end - $(date +%s) > 170 )); then sampling_files_aab; fi
  fi
  ;;
second)
  run_step vllm-stage2 40 bash .vllm/part2/remote-stage.sh 2
  if [ "${SECOND_FLEX:-0}" = 1 ]; then flex_rows; fi
  ;;
*)
  echo "unknown phase $phase (first|second)"; exit 2 ;;
esac
kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
save
since "done"
