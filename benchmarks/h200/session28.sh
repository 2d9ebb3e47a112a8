#!/usr/bin/env bash
# The GPU calls of the twenty-eighth session, each sent within 30 s of the last one's return.
#   gemm     carry nothing, any card (about 7 minutes; BUDGET_S clips it): issue 22's tensor-core W4A16 GEMM
#            for 5+ rows (w4a16_gemm_mma.py): its GPU tests against float32 (the inline-PTX decode the CPU
#            interpreter cannot run), the sweep against the routes before it and bf16 at M = 8 .. 256
#            (w4a16_gemm_mma_sweep.py, `one_dot` configs among them), then AWQ end to end at batch 1 and
#            256 with it (awq), without it (awq-before) and bf16 (E2E_ENGINES: another list, e.g. with awq-pdl)
#   mma|flex-blocks|confirm|quiet|fi-walk|first|so  = session27.sh's phases
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session28.sh gemm|mma|flex-blocks|confirm|quiet|fi-walk|first|so}
default_budget_s=${DEFAULT_BUDGET_S:-420}

case "$phase" in
mma|flex-blocks|confirm|quiet|fi-walk|first|so)
  exec bash benchmarks/h200/session27.sh "$phase" ;;
gemm)
  source benchmarks/h200/session_lib.sh
  parallel_tests 110 "gemm|tests/gpu/test_quant_gpu.py -k gemm_mma"
  run_step sweep "${SWEEP_CAP:-170}" python3 benchmarks/h200/w4a16_gemm_mma_sweep.py --out "$d" \
    --budget-s "${SWEEP_BUDGET_S:-140}"
  sed -n '/best tensor-core/,$p' "$d/sweep.log" | head -30
  run_step e2e "${E2E_CAP:-200}" python3 benchmarks/h200/quant_bench.py --out "$d/e2e" --parts e2e \
    --engines "${E2E_ENGINES:-awq,awq-before,bf16}" --quick
  grep -h '^e2e \|^{"part": "e2e"' "$d/e2e.log" | cut -c1-220
  end_phase
  ;;
*)
  echo "unknown phase $phase"; exit 2 ;;
esac
