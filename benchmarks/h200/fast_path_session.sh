#!/usr/bin/env bash
# The GPU fast-path measurements on the H200 (CUDA graphs, persistent batch, GPU sampler, fused ops,
# overlapped scheduling), beside vLLM 0.22, in two device calls on one warm machine (the second sent
# within 30 s of the first). Stage here first, in the repository root:
#   bash ../shared/gpu/vllm/stage-vllm.sh && bash ../shared/gpu/stage-flashinfer.sh
#   1. carry [".vllm/part1"]:           bash benchmarks/h200/fast_path_session.sh kvllm
#      vLLM part 1 goes to the machine; kvllm TRITON_ATTN: GPU tests (graphs vs eager, sampler),
#      fast_path_bench (latency 1/8/64/256, TTFT, nano-vllm, 256 x 128/128), the step profile.
#   2. carry [".vllm/part2"]:          bash benchmarks/h200/fast_path_session.sh vllm
#      vLLM 0.22 with its defaults through the same fast_path_bench.
#   flashinfer (carry [".fi"]): FLASHINFER's graphs-vs-eager test and fast_path_bench with its decode
#      graphs (its first use compiles for ~2 minutes).
#   WITH_SYNC=1 adds kvllm with --no-async-scheduling to call 1. Results come back as $OUT/<phase>.tgz.
#   smoke: the first lease's TRITON_ATTN-only check (graphs before the fused kernels).
#   diag (carry [".stage1"] to stage FlashAttention-4 on the way): TRITON_ATTN's nano-vllm run with a
#      per-step log and Triton compile counts (step_log.py), and step profiles at long contexts.
#   fa (carry [".stage2"], within 30 s of a call that carried ".stage1"): FLASH_ATTN (FA4):
#      graphs-vs-eager test (SKIP_TESTS=1 skips it) and fast_path_bench with the step log.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
started=$(date +%s)
since() { echo "[$(( $(date +%s) - started )) s] $*"; }
FA_PATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
FI_ENV=(PYTHONPATH=.:/tmp/site-fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws TVM_FFI_CACHE_DIR=/tmp/tvmffi MAX_JOBS=16)

bench() {  # $1 label, rest: fast_path_bench arguments; results in $d/<engine>.jsonl, a table on stdout
  local label=$1; shift
  timeout 300 python3 benchmarks/h200/fast_path_bench.py --out "$d" "$@" > "$d/bench-$label.log" 2>&1
  since "bench $label (exit $?)"
  grep -h '^{' "$d/bench-$label.log" > "$d/bench-$label.jsonl"; python3 benchmarks/h200/summarize.py "$d/bench-$label.jsonl"
}

case "${1:?usage: fast_path_session.sh kvllm|vllm|flashinfer|smoke|diag|tune|fa|host|quick}" in
kvllm)
  d=/tmp/kvllm; mkdir -p "$d"
  [ -f .vllm/part1/remote-stage.sh ] && bash .vllm/part1/remote-stage.sh 1 > "$d/vllm-stage1.log" 2>&1
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader | tee "$d/gpu.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$d/gpu.txt"
  git log --oneline -1 2>/dev/null | tee -a "$d/gpu.txt"
  KVLLM_GPU_REPORT_DIR=$d timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/gpu/test_cuda_graphs_gpu.py tests/gpu/test_sampling_gpu.py -k "TRITON or sampl or bf16 or vocab or rows" \
    > "$d/pytest-gpu.log" 2>&1
  since "GPU tests: $(tail -n 1 "$d/pytest-gpu.log")"
  bench triton --engine kvllm --backend TRITON_ATTN --iters 2 --warmups 1 --profile-batches 1,64,256 --step-log \
    --profile-long 256x1024,1x2048
  [ "${WITH_SYNC:-0}" = 1 ] && bench triton-sync --engine kvllm --backend TRITON_ATTN --no-async-scheduling \
    --only latency,nano --iters 2 --warmups 1
  tar czf "$out/kvllm.tgz" -C /tmp kvllm
  since "done"
  ;;
vllm)
  d=/tmp/vllm; mkdir -p "$d"
  bash .vllm/part2/remote-stage.sh 2 > "$d/vllm-stage2.log" 2>&1 || { cat "$d/vllm-stage2.log"; exit 3; }
  tail -n 4 "$d/vllm-stage2.log"
  (export PYTHONPATH=.:/tmp/site-vllm; bench vllm --engine vllm --iters 2 --warmups 1)
  tar czf "$out/vllm.tgz" -C /tmp vllm
  since "done"
  ;;
flashinfer)
  d=/tmp/flashinfer; mkdir -p "$d"
  bash .fi/unpack.sh > /dev/null
  env "${FI_ENV[@]}" KVLLM_GPU_REPORT_DIR=$d timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/gpu/test_cuda_graphs_gpu.py -k FLASHINFER > "$d/pytest-flashinfer.log" 2>&1
  since "FLASHINFER graph test: $(tail -n 1 "$d/pytest-flashinfer.log")"
  (export "${FI_ENV[@]}"; bench flashinfer --engine kvllm --backend FLASHINFER --iters 2 --warmups 1 --step-log)
  tar czf "$out/flashinfer.tgz" -C /tmp flashinfer
  since "done"
  ;;
diag)
  d=/tmp/diag; mkdir -p "$d"
  [ -f .stage1/unpack.sh ] && bash .stage1/unpack.sh
  git log --oneline -1 2>/dev/null | tee "$d/gpu.txt"
  bench triton-diag --engine kvllm --backend TRITON_ATTN --only nano --step-log \
    --profile-long 256x1024,64x1024,16x2048,1x2048
  tar czf "$out/diag.tgz" -C /tmp diag
  since "done"
  ;;
tune)
  d=/tmp/tune; mkdir -p "$d"
  timeout 280 python3 -m kvllm.benchmarks.attention --sweep --backends TRITON_ATTN --peers triton --only-shapes \
    --shape "decode b256 x ctx1k:256x1@1023" --shape "decode b64 x ctx1k:64x1@1023" \
    --shape "decode b16 x ctx2k:16x1@2047" --shape "decode b1 x ctx2k:1x1@2047" \
    --shape "prefill 8x2048:8x2048@0" --shape "chunks 16x512 at 512:16x512@512" --rep-ms 100 \
    --output-json "$d/attention-sweep.json" > "$d/attention-sweep.log" 2>&1
  since "attention sweep (exit $?)"
  python3 benchmarks/h200/best_configs.py "$d/attention-sweep.json" | tee "$d/best-configs.txt"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_small_m_linear_gpu.py \
    tests/gpu/test_sampling_gpu.py > "$d/pytest-gpu.log" 2>&1
  since "GPU tests (small-M linear, sampling): $(tail -n 1 "$d/pytest-gpu.log")"
  timeout 200 python3 benchmarks/h200/linear_bench.py --out "$d" > "$d/linear-bench.log" 2>&1
  since "linear bench (exit $?)"; tail -n 24 "$d/linear-bench.log"
  bench triton-diag --engine kvllm --backend TRITON_ATTN --only nano,latency --iters 2 --warmups 1 --step-log \
    --profile-batches 1,256
  tar czf "$out/tune.tgz" -C /tmp tune
  since "done"
  ;;
fa)
  d=/tmp/fa; mkdir -p "$d"
  bash .stage2/unpack.sh || exit 3
  export PYTHONPATH=$FA_PATH
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
  KVLLM_GPU_REPORT_DIR=$d timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/gpu/test_cuda_graphs_gpu.py -k FLASH_ATTN > "$d/pytest-flash-attn.log" 2>&1
  since "FLASH_ATTN graph test: $(tail -n 1 "$d/pytest-flash-attn.log")"
  fi
  bench flash-attn --engine kvllm --backend FLASH_ATTN --iters 2 --warmups 1 --step-log --profile-batches 1,256
  tar czf "$out/fa.tgz" -C /tmp fa
  since "done"
  ;;
host)  # carry [".pyspy"] (a py-spy wheel: pip download --no-deps py-spy -d .pyspy): host time of a step
  d=/tmp/host; mkdir -p "$d"
  python3 -m pip install -q --no-deps --target /tmp/pyspy .pyspy/*.whl > /dev/null 2>&1
  git log --oneline -1 2>/dev/null | tee "$d/gpu.txt"
  timeout 240 python3 benchmarks/h200/host_profile.py --out "$d" --batches 1,256 --pyspy-wait > "$d/host.log" 2>&1 &
  pid=$!
  for b in 1 256; do
    until grep -q "PYSPY pid .* batch $b" "$d/host.log" 2>/dev/null || ! kill -0 $pid 2>/dev/null; do sleep 0.2; done
    target=$(grep "PYSPY pid .* batch $b" "$d/host.log" | awk '{print $3}')
    [ -n "$target" ] && timeout 20 /tmp/pyspy/bin/py-spy record --pid "$target" --duration 3 --rate 1000 \
      --format raw --nonblocking -o "$d/pyspy-bs$b.txt" > "$d/pyspy-bs$b.log" 2>&1
  done
  wait $pid; since "host profile (exit $?)"; grep "ms/step" "$d/host.log"
  tar czf "$out/host.tgz" -C /tmp host
  since "done"
  ;;
quick)  # carry [".pyspy"]: GPU tests of the decode kernels, then batch-1..256 latency, nano-vllm and a host profile
  d=/tmp/quick; mkdir -p "$d"
  python3 -m pip install -q --no-deps --target /tmp/pyspy .pyspy/*.whl > /dev/null 2>&1
  git log --oneline -1 2>/dev/null | tee "$d/gpu.txt"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_gemv_gpu.py \
    tests/gpu/test_small_m_linear_gpu.py tests/gpu/test_cuda_graphs_gpu.py -k "not FLASH" > "$d/pytest-gpu.log" 2>&1
  since "GPU tests: $(tail -n 1 "$d/pytest-gpu.log")"
  bench triton --engine kvllm --backend TRITON_ATTN --only latency,nano --iters 2 --warmups 1 --profile-batches 1,256
  timeout 60 python3 benchmarks/h200/gemv_bench.py --out "$d" --quick > "$d/gemv-bench.log" 2>&1; tail -n 9 "$d/gemv-bench.log"
  timeout 120 python3 benchmarks/h200/host_profile.py --out "$d" --batches 1,256 > "$d/host.log" 2>&1
  since "host profile (exit $?)"; grep "ms/step" "$d/host.log"
  tar czf "$out/quick.tgz" -C /tmp quick
  since "done"
  ;;
esac
