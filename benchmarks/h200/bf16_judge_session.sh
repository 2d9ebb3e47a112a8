#!/usr/bin/env bash
# The bf16 GPU tests judged against HF float32 (tests/gpu/bf16_judge.py), in one H200 call under 4 minutes.
# Three pytest processes side by side on the one GPU (the tiny models leave it mostly idle, and every
# engine there takes a fixed-size KV cache, so none counts the others' memory as its own):
#   models   tests/gpu/test_models_gpu.py without FLASHINFER (TRITON_ATTN, FLEX_ATTENTION on Gemma 2 and
#            gpt-oss's refusal, FLASH_ATTN skipped unless installed)
#   engine   tests/gpu/test_engine_cuda.py and test_cuda_graphs_gpu.py without FLASHINFER
#   fi       every FLASHINFER case of the three files; needs FlashInfer 0.5.3 staged here first
#            (bash ../shared/gpu/stage-flashinfer.sh) and the call to carry [".fi"]; without .fi it is
#            skipped and the other two still run. Its first use compiles for about 2 minutes.
# JSON reports (one per model x backend and per backend) and logs go to $OUT/bf16_judge.tgz; a table of
# every prompt's judgement is printed last (benchmarks/h200/bf16_judge_report.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}; d=/tmp/bf16_judge; mkdir -p "$out" "$d"
export PYTHONUNBUFFERED=1 PYTHONPATH=. KVLLM_GPU_REPORT_DIR=$d
started=$(date +%s)
since() { echo "[$(( $(date +%s) - started )) s] $*"; }
pytest_gpu() {  # $1 label, rest: pytest arguments
  local label=$1; shift
  timeout 215 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE "$@" > "$d/pytest-$label.log" 2>&1
  since "$label: $(tail -n 1 "$d/pytest-$label.log")"
}
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader > "$d/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> "$d/gpu.txt"
git log --oneline -1 >> "$d/gpu.txt" 2>/dev/null
cat "$d/gpu.txt"

if [ -f .fi/unpack.sh ]; then
  bash .fi/unpack.sh > /dev/null
  (export PYTHONPATH=.:/tmp/site-fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws TVM_FFI_CACHE_DIR=/tmp/tvmffi MAX_JOBS=12
   pytest_gpu fi tests/gpu/test_engine_cuda.py tests/gpu/test_models_gpu.py tests/gpu/test_cuda_graphs_gpu.py \
     -k FLASHINFER) &
else
  since "fi: skipped (no .fi carried)"
fi
pytest_gpu models tests/gpu/test_models_gpu.py -k "not FLASHINFER" &
pytest_gpu engine tests/gpu/test_engine_cuda.py tests/gpu/test_cuda_graphs_gpu.py -k "not FLASHINFER" &
wait
python3 benchmarks/h200/bf16_judge_report.py "$d" | tee "$d/summary.txt"
tar czf "$out/bf16_judge.tgz" -C /tmp bf16_judge
since "done"
