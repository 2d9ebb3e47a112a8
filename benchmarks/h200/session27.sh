#!/usr/bin/env bash
# The GPU calls of the twenty-seventh session, each sent within 30 s of the last one's return.
#   mma      carry nothing, any card (H200 first; about 7 minutes, BUDGET_S clips it): issue 22's tensor-core
#            GEMV (w4a16_gemv_mma.py): its GPU tests against float32 (the inline-PTX pair decode the CPU
#            interpreter cannot run), then w4a16_gemv_m1.py --set mma (the defaults and this GPU's table
#            against the MMA configs, M = 1) writing a table of the fastest per shape, then AWQ / bf16 at
#            batch 1 end to end with that table, and AWQ with the shipped table / default_config
#   flex-blocks  carry nothing, any card (about 4 minutes): FLEX_ATTENTION's decode with 16-, 64- and 128-token
#            cache pages beside torch's compiled FlexAttention (b1 x 32k, b8 x 8k, b256 x 1k): its decode kernel
#            runs BLOCK_N = gcd(page, 64) keys a tile, 16 on the default pages, where it read 0.475 TB/s on b1 x 32k
#            against the peer's 1.489 (H100, twenty-sixth session); whether bigger pages for FLEX close that
#   confirm|quiet|fi-walk|first|so  = session24.sh's phases (issue 23's one-run table and walks, issue 19)
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session27.sh mma|flex-blocks|confirm|quiet|fi-walk|first|so}
default_budget_s=${DEFAULT_BUDGET_S:-420}

case "$phase" in
confirm|quiet|fi-walk|first|so)
  exec bash benchmarks/h200/session24.sh "$phase" ;;
mma)
  source benchmarks/h200/session_lib.sh
  parallel_tests 100 "mma|tests/gpu/test_quant_gpu.py -k mma"
  run_step sweep 170 python3 benchmarks/h200/w4a16_gemv_m1.py --out "$d" --set mma --budget-s 130 \
    --table-out "$d/w4a16_gemv_configs.json"
  sed -n '/best per shape/,$p' "$d/sweep.log" | head -12
  if [ -f "$d/w4a16_gemv_configs.json" ]; then
    KVLLM_W4A16_GEMV_CONFIGS=$d/w4a16_gemv_configs.json run_step e2e-mma 150 python3 \
      benchmarks/h200/quant_bench.py --out "$d/e2e-mma" --parts e2e --engines awq,bf16 --quick
    grep -h '^e2e ' "$d/e2e-mma.log" | cut -c1-200
  fi
  run_step e2e-shipped 120 python3 benchmarks/h200/quant_bench.py --out "$d/e2e-shipped" --parts e2e \
    --engines awq --quick --profile
  grep -h '^e2e ' "$d/e2e-shipped.log" | cut -c1-200
  end_phase
  ;;
flex-blocks)
  source benchmarks/h200/session_lib.sh
  for block in 16 64 128; do
    run_step "flex-b$block" 80 python3 -m kvllm.benchmarks.attention --backends FLEX_ATTENTION --peers flex \
      --only-shapes --block-size "$block" --shape "decode b1 x ctx32k:1x1@32767" \
      --shape "decode b8 x ctx8k:8x1@8191" --shape "decode b256 x ctx1k:256x1@1023" \
      --output-json "$d/flex-b$block.json"
    grep -E "FLEX_ATTENTION|flex" "$d/flex-b$block.log" | grep -v skipped | head -n 6 | cut -c1-200
  done
  end_phase
  ;;
*)
  echo "unknown phase $phase (mma|flex-blocks|confirm|quiet|fi-walk|first|so)"; exit 2 ;;
esac
