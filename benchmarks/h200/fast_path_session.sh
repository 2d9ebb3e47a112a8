#!/usr/bin/env bash
# The GPU fast-path measurements on the H200 (CUDA graphs, persistent batch, GPU sampler, fused ops).
#   smoke:  TRITON_ATTN only: graph-vs-eager GPU tests, step profiles eager vs graphs, bench latency
#           at batch 1/8/64/256 and the nano-vllm workload with graphs. Results: $OUT/smoke.tgz.
# Run from the repository root on the device machine: bash benchmarks/h200/fast_path_session.sh smoke
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
started=$(date +%s)
since() { echo "[$(( $(date +%s) - started )) s] $*"; }
q3=/tmp/qwen3-0.6b-shape
python3 -c "from kvllm.benchmarks.model_shapes import write_shape_only_model as w; w('Qwen3-0.6B', '$q3')"
ENGINE=(--model "$q3" --load-format dummy --dtype bfloat16 --max-model-len 4096)

latency() {  # $1 backend, $2 label, rest: extra flags
  local backend=$1 label=$2; shift 2
  for bs in 1 8 64 256; do
    timeout 120 python3 -m kvllm.entrypoints.cli.main bench latency "${ENGINE[@]}" --attention-backend "$backend" \
      --batch-size "$bs" --input-len 32 --output-len 128 --num-iters-warmup 2 --num-iters 5 "$@" \
      --output-json "$d/latency-$label-bs$bs.json" > "$d/latency-$label-bs$bs.log" 2>&1
    since "latency $label bs$bs: $(grep -E 'Avg latency' "$d/latency-$label-bs$bs.log")"
  done
}

nano() {  # $1 backend, $2 label, rest: extra flags
  local backend=$1 label=$2; shift 2
  timeout 240 python3 -m kvllm.entrypoints.cli.main bench throughput "${ENGINE[@]}" --attention-backend "$backend" \
    --dataset-name nano-vllm "$@" --output-json "$d/nano-$label.json" > "$d/nano-$label.log" 2>&1
  since "nano $label: $(grep -E 'Throughput|output tok' "$d/nano-$label.log" | tail -2 | tr '\n' ' ')"
}

case "${1:?usage: fast_path_session.sh smoke}" in
smoke)
  d=/tmp/smoke; mkdir -p "$d"
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader | tee "$d/gpu.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$d/gpu.txt"
  KVLLM_GPU_REPORT_DIR=$d timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -x \
    tests/gpu/test_cuda_graphs_gpu.py -k TRITON > "$d/pytest-graphs.log" 2>&1
  since "graph tests: $(tail -n 1 "$d/pytest-graphs.log")"
  ls tests/gpu/test_layer_ops_gpu.py > /dev/null 2>&1 && { timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
    -rfE tests/gpu/test_layer_ops_gpu.py > "$d/pytest-layer-ops.log" 2>&1; since "layer ops: $(tail -n 1 "$d/pytest-layer-ops.log")"; }
  timeout 150 python3 benchmarks/h200/step_profile.py --out "$d" --enforce-eager > "$d/profile-eager.log" 2>&1
  tail -n 5 "$d/profile-eager.log"
  timeout 150 python3 benchmarks/h200/step_profile.py --out "$d" > "$d/profile-graphs.log" 2>&1
  tail -n 5 "$d/profile-graphs.log"
  latency TRITON_ATTN triton-graphs
  nano TRITON_ATTN triton-graphs
  tar czf "$out/smoke.tgz" -C /tmp smoke
  since "done"
  ;;
esac
