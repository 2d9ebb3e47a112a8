#!/usr/bin/env bash
# The GPU calls of the twenty-fourth session, each sent within 30 s of the last one's return.
#   confirm|minimal|quiet|fi-walk|first  = session23.sh's phases (issue 23, then issue 22's H200 table)
#   lean carry nothing, any card (about 5 minutes; BUDGET_S, default 340, clips it): confirm without the staging
#        and the kernel tests, for a short lease: the auto route's engine test against HF float32, the probe,
#        then prefill_routing.py 0 / auto@2048 / 0 / auto@2048 on 1 x 2,048 and 8 x 2,048
#   so   carry [".so-lite"] (staged by stage-structured-outputs.sh), any card (about 5 minutes): issue 19's
#        batch-64 bench with xgrammar's thread pool filling the masks from 16 rows (t16) against the default
#        (t128: the calling thread below 128 rows), alternating t128, t16, t128, t16, t128, t16; first
#        benchmarks/xgrammar_gil.py on the host's CPU (the fill's time by pool size, no GPU)
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session24.sh confirm|minimal|lean|quiet|fi-walk|first|so}
default_budget_s=${DEFAULT_BUDGET_S:-420}

case "$phase" in
confirm|minimal|quiet|fi-walk|first)
  exec bash benchmarks/h200/session23.sh "$phase" ;;
lean)
  default_budget_s=340
  source benchmarks/h200/session_lib.sh
  parallel_tests 110 "engine|tests/gpu/test_engine_cuda.py -k auto_prefill"
  run_step probe 50 python3 benchmarks/h200/prefill_launch_probe.py --out "$d" --iters 30
  grep -h '^{' "$d/probe.log" | cut -c1-140
  run_step e2e 150 python3 benchmarks/h200/prefill_routing.py --out "$d" --timeout-s 45 \
    --order "${ROUTING_ORDER:-0,auto@2048,0,auto@2048}" --cases 1x2048,8x2048
  sed -n '/case/,$p' "$d/e2e.log"
  end_phase
  ;;
so)
  source benchmarks/h200/session_lib.sh
  stage_structured_outputs || { since "no .so-lite"; end_phase; exit 3; }
  (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok
   # xgrammar's fill by pool size on this host's CPU (the 2-core CPU machine: 2 threads 1.8x slower at 64 rows)
   tok_cache=$HOME/.cache/kvllm-tests/qwen3-tokenizer-3.7.2; mkdir -p "$tok_cache"; cp /tmp/so-tok/* "$tok_cache"/
   run_step gil 60 python3 benchmarks/xgrammar_gil.py --repeats 200 --output-json "$d/xgrammar_gil.json"
   grep -A6 by_threads "$d/gil.log" | tr -d '\n '; echo
   i=0
   for rows in ${SO_ARMS:-128 16 128 16 128 16}; do
     i=$((i + 1))
     run_step "so-t$rows-$i" 60 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer /tmp/so-tok \
       --repeats 3 --threaded-fill-min-rows "$rows" --out "$d/so-t$rows-$i.json"
     tail -n 1 "$d/so-t$rows-$i.log"
   done)
  end_phase
  ;;
*)
  echo "unknown phase $phase (confirm|minimal|lean|quiet|fi-walk|first|so)"; exit 2 ;;
esac
