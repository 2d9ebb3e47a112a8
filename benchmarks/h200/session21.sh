#!/usr/bin/env bash
# The next session's GPU calls, left by the twenty-first (its H200 ran issue 17 beside vLLM, issue 19's pair
# and the PDL A/B; what it could not run is below). Two calls on one warm machine, the second sent within
# 30 s of the first one's return. Stage once, here in the repository root (done in the twenty-first
# session; rerun if .stage1, .stage2 or .fi are gone):
#   bash ../shared/gpu/stage-flashinfer.sh && bash ../shared/gpu/stage-flash-attn-4.sh
#   first   carry [".stage1", ".fi"] (56 MB): FA4's first piece and FlashInfer unpacked; on an H200, issue 22's
#           missing piece: the W4A16 GEMV's own H200 table (w4a16_gemv_m1.py --table-out) and the batch-1
#           AWQ / bf16 e2e with it (the twenty-first session: 3.07 / 4.43 ms with default_config, 1.44x).
#           If the table wins, add its H200 row to kvllm/layers/quantization/ops/w4a16_gemv_configs.json.
#           On an H100 (it has its table), the e2e only.
#   second  carry [".stage2"] (52 MB): benchmarks/h200/backends_session.sh, issue 23's one run (FlashInfer's
#           walk and sink kernels, FLEX beside its peers, auto-tune twice, FA4's walk and probes, the bf16
#           greedy tests; about 4.5 minutes).
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session21.sh first|second}
default_budget_s=${DEFAULT_BUDGET_S:-480}

case "$phase" in
first)
  source benchmarks/h200/session_lib.sh
  [ -f .stage1/unpack.sh ] && run_step stage1 60 bash .stage1/unpack.sh
  [ -f .fi/unpack.sh ] && run_step fi-unpack 60 bash .fi/unpack.sh
  if on_h200; then
    run_step sweep 150 python3 benchmarks/h200/w4a16_gemv_m1.py --out "$d" --budget-s 100 \
      --table-out "$d/w4a16_gemv_configs.json"
    sed -n '/best per shape/,$p' "$d/sweep.log" | head -24
    if [ -f "$d/w4a16_gemv_configs.json" ]; then
      KVLLM_W4A16_GEMV_CONFIGS=$d/w4a16_gemv_configs.json run_step e2e-tuned 200 python3 \
        benchmarks/h200/quant_bench.py --out "$d/e2e-tuned" --parts e2e --engines awq,bf16 --quick
      grep -h '"e2e"' "$d/e2e-tuned.log" | cut -c1-200
    fi
    run_step e2e-default 120 python3 benchmarks/h200/quant_bench.py --out "$d/e2e-default" --parts e2e \
      --engines awq --quick
    grep -h '"e2e"' "$d/e2e-default.log" | cut -c1-200
  else
    run_step e2e 200 python3 benchmarks/h200/quant_bench.py --out "$d/e2e" --parts e2e --engines awq,bf16 --quick
    grep -h '"e2e"' "$d/e2e.log" | cut -c1-200
  fi
  kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
  save
  since "done"
  ;;
second)
  bash benchmarks/h200/backends_session.sh
  ;;
*)
  echo "unknown phase $phase (first|second)"; exit 2 ;;
esac
