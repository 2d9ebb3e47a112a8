#!/usr/bin/env bash
# The GPU calls of the twenty-ninth session, each sent within 30 s of the last one's return.
#   rows     carry nothing, any card (about 5 minutes; BUDGET_S clips it): issue 22's W4A16 routes after 2-4 rows
#            moved from the GEMV to the tensor-core GEMM and the GEMM's defaults took `one_dot` where the H100
#            sweep had it faster: the GEMM's and the dispatch's GPU tests (2 and 3 rows added); AWQ end to end
#            (batch 1, 4 and 256) with today's routes (awq), with the GEMV for 1-4 rows (awq-gemv4) and bf16;
#            the defaults' sweep at 2 .. 256 rows; on an H200 then the one-row GEMV sweep (`--set h200`) and its table
#            end to end (the H200 rows w4a16_gemv_configs.json lacks)
#   h200     carry [".so-lite"] (optional), any card, meant for the H200 (about 8 minutes; BUDGET_S clips it):
#            the open H200 numbers of issues 22 and 19 in one call, most needed first: AWQ and bf16 end to end
#            (batch 1, 4, 256); with .so-lite the batch-64 structured-outputs bench three times; the GEMM's and
#            the dispatch's GPU tests; on an H200 the one-row GEMV sweep (`--set h200`: CUDA-core and tensor-core) and its table end to end
#   *        = session28.sh's phases
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session29.sh rows|h200|gemm|mma|flex-blocks|confirm|quiet|fi-walk|first|so}
default_budget_s=${DEFAULT_BUDGET_S:-420}

# gemv_table E2E_CAP: the one-row GEMV sweep for the H200 (CUDA-core and tensor-core configs), then AWQ end to
# end with each shape's fastest config
gemv_table() {
  run_step gemv-sweep 170 python3 benchmarks/h200/w4a16_gemv_m1.py --out "$d" --set h200 --budget-s 130 \
    --table-out "$d/w4a16_gemv_configs.json"
  sed -n '/best per shape/,$p' "$d/gemv-sweep.log" | head -12
  if [ -f "$d/w4a16_gemv_configs.json" ]; then
    KVLLM_W4A16_GEMV_CONFIGS=$d/w4a16_gemv_configs.json run_step e2e-table "$1" python3 \
      benchmarks/h200/quant_bench.py --out "$d/e2e-table" --parts e2e --engines awq --quick
    grep -h '^e2e ' "$d/e2e-table.log" | cut -c1-220
  fi
}

case "$phase" in
rows)
  source benchmarks/h200/session_lib.sh
  parallel_tests 70 "rows|tests/gpu/test_quant_gpu.py -k 'gemm_mma or dispatch'"
  run_step e2e "${E2E_CAP:-220}" python3 benchmarks/h200/quant_bench.py --out "$d/e2e" --parts e2e \
    --engines "${E2E_ENGINES:-awq,awq-gemv4,bf16}" --quick
  grep -h '^e2e ' "$d/e2e.log" | cut -c1-220
  run_step sweep 60 python3 benchmarks/h200/w4a16_gemm_mma_sweep.py --out "$d" --defaults-only \
    --rows 2,4,8,16,32,128,256 --budget-s 45
  sed -n '/best tensor-core/,$p' "$d/sweep.log" | head -30
  on_h200 && gemv_table 150
  end_phase
  ;;
h200)
  source benchmarks/h200/session_lib.sh
  run_step e2e 130 python3 benchmarks/h200/quant_bench.py --out "$d/e2e" --parts e2e --engines awq,bf16 --quick
  grep -h '^e2e ' "$d/e2e.log" | cut -c1-220
  so_runs 3
  parallel_tests 70 "rows|tests/gpu/test_quant_gpu.py -k 'gemm_mma or dispatch'"
  on_h200 && gemv_table 100
  end_phase
  ;;
*)
  exec bash benchmarks/h200/session28.sh "$phase" ;;
esac
