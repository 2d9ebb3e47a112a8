#!/usr/bin/env bash
# The GPU calls the twenty-second session ran (routing, second) and the ones it leaves, each sent within 30 s
# of the last one's return. Every phase but `routing` writes its outputs as one tarball under $OUT (a call
# returns a limited number of files).
#   routing  carry [".stage1", ".fi"] (FA4's first piece and FlashInfer, unpacked first for `second`; about
#            4 minutes): where TRITON_ATTN's prefill kernel beats the unified kernel, alone and end to end:
#            prefill_sweep.py over the standard and shorter prefill shapes, the attention bench's prefill rows
#            with the kernel forced, then prefill_routing.py (time to first token, on / off / on / off)
#   second   carry [".stage2"] = session21.sh second (issue 23's one-run table, about 4.5 minutes; its FlashInfer
#            compile runs beside the timed rows: `quiet` and `fi-walk` split it)
#   first    carry nothing on the same warm machine = session21.sh first (issue 22's H200 W4A16 table)
# Left for the next session:
#   confirm  carry [".stage1", ".fi"] (unpacked first, for `quiet`), any card (about 5 minutes): the default
#            (auto) prefill route on a GPU: its engine test against HF float32 and the prefill kernel's GPU
#            tests, then prefill_routing.py auto / 0 / auto / 0 on 1k-16k prompts (auto must equal 0 below
#            4,096 tokens a request and win above)
#   quiet    after `confirm` (or `routing`), carry [".stage2"]: backends_session.sh without the FlashInfer walk
#            (FLEX rows, auto-tune twice, FA4's walk and probes, the greedy tests)
#   fi-walk  on the same warm machine, carry nothing: FlashInfer's walk alone for FI_DEADLINE_S (440 s), then its
#            greedy test; a second call continues it (the compiled modules persist)
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session22.sh routing|second|first|confirm|quiet|fi-walk}
default_budget_s=${DEFAULT_BUDGET_S:-420}

case "$phase" in
first|second)
  exec bash benchmarks/h200/session21.sh "$phase" ;;
quiet|fi-walk)
  tmp=/tmp/$phase; mkdir -p "$tmp"
  if [ "$phase" = quiet ]; then mode=skip; else mode=only; fi
  OUT=$tmp FI_WALK=$mode FI_DEADLINE_S=${FI_DEADLINE_S:-440} timeout -k 5 "${BUDGET_S:-560}" \
    bash benchmarks/h200/backends_session.sh > "$tmp/session.log" 2>&1
  tar czf "${OUT:-gpu-out}/$phase.tgz" -C /tmp "$phase"
  tail -n 40 "$tmp/session.log"
  ;;
confirm)
  source benchmarks/h200/session_lib.sh
  [ -f .stage1/unpack.sh ] && run_step stage1 60 bash .stage1/unpack.sh
  [ -f .fi/unpack.sh ] && run_step fi-unpack 60 bash .fi/unpack.sh
  run_step tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_engine_cuda.py \
    -k auto_prefill
  run_step kernel-tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_triton_prefill_gpu.py
  run_step e2e 200 python3 benchmarks/h200/prefill_routing.py --out "$d" --timeout-s 60 --order auto,0,auto,0 \
    --cases 1x1024,1x2048,1x4096,2x4096,1x16384,8x2048,32x512
  sed -n '/case/,$p' "$d/e2e.log"
  kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
  save
  since "done"
  ;;
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
  echo "unknown phase $phase (routing|second|first|confirm|quiet|fi-walk)"; exit 2 ;;
esac
