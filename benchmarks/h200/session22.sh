#!/usr/bin/env bash
# The twenty-second session's GPU calls, most wanted first, each sent within 30 s of the last one's return:
#   routing  carry [".stage1", ".fi"] (FA4's first piece and FlashInfer, unpacked first for `second`; about
#            4 minutes): where TRITON_ATTN's prefill kernel beats the unified kernel, alone and end to end,
#            to decide its routing (it is opt-in; issue 23's 350 TFLOP/s prefill target is the prefill
#            kernel's number, 378 in the ninth session): prefill_sweep.py over the standard and shorter
#            prefill shapes (both kernels' defaults, and the prefill kernel reading the cache only), the
#            attention bench's prefill rows with the kernel on and off, then prefill_routing.py (time to
#            first token, kernel on / off / on / off, one engine each)
#   second   carry [".stage2"] = session21.sh second (issue 23's one-run table, about 4.5 minutes)
#   first    carry nothing on the same warm machine = session21.sh first (issue 22's H200 W4A16 table)
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session22.sh first|routing|second}
default_budget_s=${DEFAULT_BUDGET_S:-420}

case "$phase" in
first|second)
  exec bash benchmarks/h200/session21.sh "$phase" ;;
routing)
  source benchmarks/h200/session_lib.sh
  [ -f .stage1/unpack.sh ] && run_step stage1 60 bash .stage1/unpack.sh
  [ -f .fi/unpack.sh ] && run_step fi-unpack 60 bash .fi/unpack.sh
  run_step sweep 110 python3 benchmarks/h200/prefill_sweep.py --out-dir "$d" --budget-s 75 \
    --only "unified default,prefill default,prefill m128-n64-w8-s3-gather" --shapes "causal,cached" --peers sdpa
  grep -E "^  " "$d/sweep.log" | cut -c1-160 | head -60
  # The issue's row through the bench's TRITON_ATTN path with the kernel on (the sweep has both kernels).
  KVLLM_TRITON_PREFILL_KERNEL=1 run_step attn-prefill 50 python3 -m kvllm.benchmarks.attention \
    --backends TRITON_ATTN --peers triton --only-shapes --shape "prefill 8x2048 causal:8x2048@0" \
    --shape "prefill 32x512 causal:32x512@0" --output-json "$d/attn-prefill.json"
  grep -E "TRITON|triton" "$d/attn-prefill.log" | grep -v skipped | head -n 6
  run_step e2e 170 python3 benchmarks/h200/prefill_routing.py --out "$d" --timeout-s 60 \
    --cases 1x1024,1x4096,1x16384,8x2048,32x512
  sed -n '/speed-up/,$p' "$d/e2e.log"
  kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
  save
  since "done"
  ;;
*)
  echo "unknown phase $phase (first|routing|second)"; exit 2 ;;
esac
