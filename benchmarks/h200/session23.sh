#!/usr/bin/env bash
# The GPU calls of the twenty-third session, each sent within 30 s of the last one's return.
#   confirm  carry [".stage1", ".fi"] (unpacked first, for `quiet`), any card (about 6 minutes): the default
#            (auto) prefill route on a GPU: its engine test against HF float32 and the prefill kernel's GPU
#            tests; prefill_launch_probe.py (host and GPU time a call of each prefill path: where the forced
#            kernel's 2.8 ms at 1,024 tokens goes); then prefill_routing.py 0 / auto@2048 / auto / 0 /
#            auto@2048 on 1k-4k prompts and 8 x 2,048 (auto must equal 0 below its threshold; auto@2048 tries
#            a lower one; ROUTING_ORDER replaces the order)
#   minimal  confirm's engine test and probe alone (about 2.5 minutes), when little device time is left
#   quiet    = session22.sh quiet (carry [".stage2"]): the backends call without FlashInfer's walk
#   fi-walk  = session22.sh fi-walk (carry nothing): FlashInfer's walk alone
#   first    = session22.sh first (H200 only; carry nothing): issue 22's H200 W4A16 table
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session23.sh confirm|minimal|quiet|fi-walk|first}
default_budget_s=${DEFAULT_BUDGET_S:-500}

case "$phase" in
quiet|fi-walk|first)
  exec bash benchmarks/h200/session22.sh "$phase" ;;
confirm)
  source benchmarks/h200/session_lib.sh
  [ -f .stage1/unpack.sh ] && run_step stage1 60 bash .stage1/unpack.sh
  [ -f .fi/unpack.sh ] && run_step fi-unpack 60 bash .fi/unpack.sh
  run_step probe 60 python3 benchmarks/h200/prefill_launch_probe.py --out "$d"
  grep -h '^{' "$d/probe.log" | cut -c1-140
  parallel_tests 150 "engine|tests/gpu/test_engine_cuda.py -k auto_prefill" \
    "kernel|tests/gpu/test_triton_prefill_gpu.py"
  run_step e2e 200 python3 benchmarks/h200/prefill_routing.py --out "$d" --timeout-s 50 \
    --order "${ROUTING_ORDER:-0,auto@2048,auto,0,auto@2048}" --cases 1x1024,1x2048,1x4096,8x2048
  sed -n '/case/,$p' "$d/e2e.log"
  kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
  save
  since "done"
  ;;
minimal)  # confirm's first half, when little device time is left: the auto route's engine test and the probe
  source benchmarks/h200/session_lib.sh
  parallel_tests 120 "engine|tests/gpu/test_engine_cuda.py -k auto_prefill"
  run_step probe 45 python3 benchmarks/h200/prefill_launch_probe.py --out "$d" --iters 30
  grep -h '^{' "$d/probe.log" | cut -c1-140
  kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
  save
  since "done"
  ;;
*)
  echo "unknown phase $phase (confirm|minimal|quiet|fi-walk|first)"; exit 2 ;;
esac
