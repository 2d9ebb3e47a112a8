#!/usr/bin/env bash
# Run the FLASH_ATTN (FA4) or FLASHINFER GPU conformance tests on the H200 in one device call.
#
#   bash benchmarks/h200/run_flash_backends.sh fa4                  # after .stage2/unpack.sh (see stage-flash-attn-4.sh)
#   bash benchmarks/h200/run_flash_backends.sh flashinfer [PART]    # unpacks .fi itself when carried
#
# FlashInfer PART (compiled modules persist in /tmp/fiws while the machine stays warm, so later
# parts reuse earlier compiles): core (declared, 16-bit KV), fp8 (declared, fp8 KV), declared
# (both), paths (batch shapes, tensor-core decode, padding), widen (implemented but not declared:
# more head and block sizes, window, soft-cap; about 25 minutes of first-use compiling), all.
# Default: declared.
# FlashInfer runs SHARDS (default 4) pytest processes over whole compile groups, in parallel.
# Full logs and JUnit XML go to $OUT (or ./gpu-out); a short table is printed last.
# The two libraries need different tvm-ffi versions: never run both in one process.
set -uo pipefail
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
out=${OUT:-gpu-out}; mkdir -p "$out"
lib=${1:?usage: run_flash_backends.sh fa4|flashinfer [PART]}
budget=${BUDGET_S:-540}  # stop before the 600 s device-call limit so results still come back

summary() {  # one line per log: its pytest closing line, then every failure
  for f in "$@"; do printf '%-28s %s\n' "$(basename "$f")" "$(grep -E '(passed|failed|error|skipped|no tests ran)' "$f" | tail -1)"; done
  grep -h -E '^(FAILED|ERROR) ' "$@" | sort -u | head -40
}

nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1

case "$lib" in
fa4)
  export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
  python3 -c "import flash_attn.cute, torch; print('flash_attn.cute OK, torch', torch.__version__)" > "$out/fa4-env.txt" 2>&1 \
    || { cat "$out/fa4-env.txt"; echo "flash_attn.cute not importable: run .stage1/.stage2 first"; exit 3; }
  timeout "$budget" python3 -m pytest tests/gpu/test_flash_attn_gpu.py -m gpu -q -rfE -p no:cacheprovider \
    --junitxml="$out/fa4-junit.xml" > "$out/fa4.log" 2>&1
  rc=$?
  summary "$out/fa4.log"
  exit $rc
  ;;
flashinfer)
  [ -f .fi/unpack.sh ] && bash .fi/unpack.sh
  export PYTHONPATH=.:/tmp/site-fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws TVM_FFI_CACHE_DIR=/tmp/tvmffi
  shards=${SHARDS:-4}
  export MAX_JOBS=$(( $(nproc) / shards > 0 ? $(nproc) / shards : 1 ))
  case "${2:-declared}" in
    core) sel='declared and not fp8' ;;
    fp8) sel='declared and fp8' ;;
    declared) sel='declared' ;;
    paths) sel='batch_shapes or tensor_core or padding' ;;
    widen) sel='widen' ;;
    all) sel='' ;;
    *) echo "unknown part ${2}"; exit 2 ;;
  esac
  # Build tvm-ffi's torch add-on once, before the shards import flashinfer concurrently.
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" > "$out/fi-env.txt" 2>&1 \
    || { cat "$out/fi-env.txt"; exit 3; }
  part=${2:-declared}; logs=()
  for i in $(seq 0 $((shards - 1))); do
    log="$out/fi-$part-shard$i.log"; logs+=("$log")
    KVLLM_GPU_SHARD="$i/$shards" timeout "$budget" python3 -m pytest tests/gpu/test_flashinfer_gpu.py -m gpu -q -rfE \
      -p no:cacheprovider ${sel:+-k "$sel"} --junitxml="$out/fi-$part-shard$i.xml" > "$log" 2>&1 &
  done
  rc=0; for job in $(jobs -p); do wait "$job" || rc=1; done
  summary "${logs[@]}"
  exit $rc
  ;;
*) echo "usage: run_flash_backends.sh fa4|flashinfer [PART]"; exit 2 ;;
esac
