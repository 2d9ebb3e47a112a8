#!/usr/bin/env bash
# The FLASH_ATTN + FLASHINFER measurement session on the H200, in three device calls on one warm machine
# (each within 30 s of the previous one). Stage both libraries here first:
#   bash ../shared/gpu/stage-flash-attn-4.sh && bash ../shared/gpu/stage-flashinfer.sh
#
#   1. carry .stage1 .fi:  bash benchmarks/h200/run_flash_session.sh start
#        FA4 stage 1 goes to the machine; FlashInfer is unpacked and its conformance walk, its engine
#        greedy test and its automatic-selection check start in the background (setsid, results in
#        /tmp/fi-out), so its ~2 min of first-use compiling overlaps call 2.
#   2. carry .stage2:      bash benchmarks/h200/run_flash_session.sh fa
#        FA4 process: automatic selection with FA4 present, `kvllm bench attention` rows for
#        TRITON_ATTN / FLEX_ATTENTION / FLASH_ATTN beside SDPA, FlexAttention and FA4, then (once the
#        background FlashInfer work is done, so nothing else loads the host) the end-to-end sweep with
#        FLASH_ATTN beside HF. Everything comes back as $OUT/fa.tgz.
#   3. carry .fi:          bash benchmarks/h200/run_flash_session.sh fi
#        FlashInfer process: the background results, the attention rows for FLASHINFER beside the
#        FlashInfer library alone and TRITON_ATTN, then the end-to-end sweep with FLASHINFER beside
#        TRITON_ATTN (nano-vllm's workload with automatic selection). Comes back as $OUT/fi.tgz.
# The two libraries need different tvm-ffi versions: they never share a process.
set -uo pipefail
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
out=${OUT:-gpu-out}; mkdir -p "$out"
started=$(date +%s)
export PYTHONUNBUFFERED=1
FA_PATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
FI_ENV=(PYTHONPATH=.:/tmp/site-fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws TVM_FFI_CACHE_DIR=/tmp/tvmffi)

left() { echo $(( ${CALL_BUDGET_S:-570} - ($(date +%s) - started) )); }

auto_selection() {  # $1: log file. Which backend `kvllm backends` picks for Qwen3-0.6B here, and why.
  python3 -c "from kvllm.benchmarks.model_shapes import write_shape_only_model as w; w('Qwen3-0.6B', '/tmp/q3')" &&
    python3 -m kvllm.entrypoints.cli.main backends /tmp/q3 --dtype bfloat16 > "$1" 2>&1
  echo "auto selection (exit $?):"; grep -E "Automatic selection|rejected" "$1" | head -5
}

fi_background() {  # runs detached from call 1; every result lands in /tmp/fi-out
  local d=/tmp/fi-out; mkdir -p "$d"
  for part in declared paths; do  # fp8 is part of declared since the H200 run
    OUT=$d SHARDS=4 BUDGET_S=300 bash benchmarks/h200/run_flash_backends.sh flashinfer "$part" > "$d/part-$part.txt" 2>&1
  done
  env "${FI_ENV[@]}" KVLLM_GPU_REPORT_DIR="$d" timeout 240 python3 -m pytest tests/gpu/test_engine_cuda.py -m gpu \
    -k FLASHINFER -q -rfE -p no:cacheprovider > "$d/engine-greedy.log" 2>&1
  env "${FI_ENV[@]}" bash -c "$(declare -f auto_selection); auto_selection $d/auto-selection.txt" > /dev/null 2>&1
  touch "$d/DONE"
}

case "${1:?usage: run_flash_session.sh start|fa|fi|fi-background}" in
start)
  bash .stage1/unpack.sh
  bash .fi/unpack.sh
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader
  setsid nohup bash "$0" fi-background > /tmp/fi-background.log 2>&1 < /dev/null &
  echo "FlashInfer work started in the background"
  ;;
fi-background)
  fi_background
  ;;
fa)
  bash .stage2/unpack.sh || exit 3
  d=/tmp/fa-out; mkdir -p "$d"
  export PYTHONPATH=$FA_PATH
  auto_selection "$d/auto-selection.txt"
  OUT=$d BUDGET_S=200 ARGS="--backends TRITON_ATTN,FLEX_ATTENTION,FLASH_ATTN" bash benchmarks/h200/run_core.sh attention \
    > "$d/attention-summary.txt" 2>&1
  tail -n 25 "$d/attention-summary.txt"
  for _ in $(seq 60); do [ -f /tmp/fi-out/DONE ] && break; sleep 3; done
  echo "background FlashInfer work done: $([ -f /tmp/fi-out/DONE ] && echo yes || echo 'no (e2e runs beside it)')"
  budget=$(( $(left) - 30 ))
  [ "$budget" -gt 60 ] && timeout $((budget + 25)) python3 benchmarks/sweep_e2e.py --out "$d/e2e" --backends FLASH_ATTN \
    --skip-nano-hf --budget-s "$budget" > "$d/e2e.log" 2>&1
  tail -n 22 "$d/e2e.log"
  tar czf "$out/fa.tgz" -C /tmp fa-out
  ;;
fi)
  [ -f .fi/unpack.sh ] && bash .fi/unpack.sh > /dev/null
  d=/tmp/fi-run; mkdir -p "$d"
  [ -f /tmp/fi-out/DONE ] || echo "background FlashInfer work not finished: $(ls /tmp/fi-out 2>/dev/null | tr '\n' ' ')"
  for f in /tmp/fi-out/part-*.txt; do echo "== $f"; tail -n 8 "$f"; done
  tail -n 5 /tmp/fi-out/engine-greedy.log 2>/dev/null
  grep -E "Automatic selection|rejected" /tmp/fi-out/auto-selection.txt 2>/dev/null | head -3
  env "${FI_ENV[@]}" timeout 170 python3 -m kvllm.benchmarks.attention --backends TRITON_ATTN,FLASHINFER \
    --peers triton,triton-kv-write,sdpa,flashinfer --output-json "$d/attention-fi.json" > "$d/attention-fi.log" 2>&1
  grep -A40 "^== " "$d/attention-fi.log" | head -40
  budget=$(( $(left) - 30 ))
  [ "$budget" -gt 60 ] && env "${FI_ENV[@]}" timeout $((budget + 25)) python3 benchmarks/sweep_e2e.py --out "$d/e2e" \
    --backends FLASHINFER,TRITON_ATTN --skip-hf --skip-nano-hf --budget-s "$budget" > "$d/e2e.log" 2>&1
  tail -n 22 "$d/e2e.log"
  cp -r /tmp/fi-out "$d/background" 2>/dev/null
  tar czf "$out/fi.tgz" -C /tmp fi-run
  ;;
*) echo "usage: run_flash_session.sh start|fa|fi"; exit 2 ;;
esac
