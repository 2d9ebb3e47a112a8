#!/usr/bin/env bash
# The twenty-second session's GPU calls: session21.sh's two (issue 22's H200 W4A16 table, issue 23's
# one-run table) and, between them, `routing`: where TRITON_ATTN's prefill kernel beats the unified
# kernel, alone and end to end, to decide its routing (it is opt-in; issue 23's 350 TFLOP/s prefill
# target is the prefill kernel's number, 378 in the ninth session).
#   first    carry [".stage1", ".fi"]   = session21.sh first
#   routing  carry nothing (any card, about 4 minutes): prefill_sweep.py over the standard and shorter
#            prefill shapes (the unified and prefill kernels' defaults, and the prefill kernel reading
#            the cache only), the attention bench's prefill row with the kernel on and off, then
#            prefill_routing.py (time to first token, kernel on / off / on / off, one engine each)
#   second   carry [".stage2"]          = session21.sh second
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session22.sh first|routing|second}
default_budget_s=${DEFAULT_BUDGET_S:-420}

case "$phase" in
first|second)
  exec bash benchmarks/h200/session21.sh "$phase" ;;
routing)
  source benchmarks/h200/session_lib.sh
  run_step sweep 150 python3 benchmarks/h200/prefill_sweep.py --out-dir "$d" --budget-s 110 \
    --only "unified default,prefill default,prefill m128-n64-w8-s3-gather" --shapes "causal,cached" --peers sdpa
  grep -E "^  " "$d/sweep.log" | cut -c1-160 | head -60
  for on in 1 0; do
    KVLLM_TRITON_PREFILL_KERNEL=$on run_step "attn-prefill-$on" 60 python3 -m kvllm.benchmarks.attention \
      --backends TRITON_ATTN --peers triton --only-shapes --shape "prefill 8x2048 causal:8x2048@0" \
      --shape "prefill 32x512 causal:32x512@0" --output-json "$d/attn-prefill-$on.json"
    grep -E "TRITON|triton" "$d/attn-prefill-$on.log" | grep -v skipped | head -n 6
  done
  run_step e2e 200 python3 benchmarks/h200/prefill_routing.py --out "$d" --timeout-s 90
  sed -n '/speed-up/,$p' "$d/e2e.log"
  kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
  save
  since "done"
  ;;
*)
  echo "unknown phase $phase (first|routing|second)"; exit 2 ;;
esac
