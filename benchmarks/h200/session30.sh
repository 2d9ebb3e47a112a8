#!/usr/bin/env bash
# The GPU calls of the thirtieth session, each sent within 30 s of the last one's return. A call naming
# nvidia-h200 gets an H100 or an H200, and the card is known only once it runs, so the first call picks its
# work by the card:
#   first    carry [".stage1", ".fi"], any card: on an H200 only the staging's first half and FlashInfer unpacked
#            (seconds; then `quiet`, carry [".stage2"], within 30 s: issue 23's one-run table); on an H100 (issue 23 ran there in the twenty-sixth
#            session) the one-row W4A16 GEMV sweep `--set h200` (deeper CUDA-core pipelines beside the
#            shipped H100 table and the tensor-core leaders), AWQ end to end with its table against the
#            shipped one, and the sleep-mode GPU tests, not run on a GPU since they were written
#   *        = session29.sh's phases
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session30.sh first|rows|h200|gemm|mma|flex-blocks|confirm|quiet|fi-walk|so}
default_budget_s=${DEFAULT_BUDGET_S:-420}

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
  run_step gemv-sweep 200 python3 benchmarks/h200/w4a16_gemv_m1.py --out "$d" --set h200 --budget-s 160 \
    --table-out "$d/w4a16_gemv_configs.json"
  sed -n '/best per shape/,$p' "$d/gemv-sweep.log" | head -12
  if [ -f "$d/w4a16_gemv_configs.json" ]; then
    KVLLM_W4A16_GEMV_CONFIGS=$d/w4a16_gemv_configs.json run_step e2e-table 100 python3 \
      benchmarks/h200/quant_bench.py --out "$d/e2e-table" --parts e2e --engines awq --quick
    run_step e2e-shipped 100 python3 benchmarks/h200/quant_bench.py --out "$d/e2e-shipped" --parts e2e \
      --engines awq --quick
    grep -h '^e2e ' "$d/e2e-table.log" "$d/e2e-shipped.log" | cut -c1-220
  fi
  parallel_tests 120 "sleep|tests/gpu/test_sleep_mode_gpu.py"
  end_phase
  ;;
*)
  exec bash benchmarks/h200/session29.sh "$phase" ;;
esac
