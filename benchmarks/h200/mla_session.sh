#!/usr/bin/env bash
# MLA on the H200 in one device call (about 4 minutes, at most 4m45s by its timeouts; carry [".fi"] for FLASHINFER_MLA, see
# ../shared/gpu/stage-flashinfer.sh; without it the FlashInfer parts are skipped with their reason):
#   1. tests/gpu/test_mla_gpu.py: TRITON_MLA and FLASHINFER_MLA against float32 over their declared
#      combinations (bf16 only unless MLA_DTYPES says more: FlashInfer compiles per dtype);
#   2. mla_bench.py kernels: the decode kernels alone, TRITON_MLA beside FlashInfer's MLA wrapper;
#   3. kvllm bench throughput on a DeepSeek-V2-Lite-shaped dummy model with each MLA backend.
# Everything goes to $OUT (or ./gpu-out): logs, JUnit XML, JSON; a short summary is printed last.
set -uo pipefail
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
out=${OUT:-gpu-out}; mkdir -p "$out"
[ -f .fi/unpack.sh ] && bash .fi/unpack.sh > "$out/fi-unpack.txt" 2>&1
export PYTHONPATH=.:/tmp/site-fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws TVM_FFI_CACHE_DIR=/tmp/tvmffi MAX_JOBS=16
export KVLLM_MLA_GPU_DTYPES=${MLA_DTYPES:-bfloat16}
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1

timeout 120 python3 -m pytest tests/gpu/test_mla_gpu.py -m gpu -q -rfE -p no:cacheprovider \
  --junitxml="$out/mla-junit.xml" > "$out/mla-tests.log" 2>&1
timeout 45 python3 benchmarks/h200/mla_bench.py kernels --out "$out/mla_kernels.json" > "$out/mla-kernels.log" 2>&1
python3 benchmarks/h200/mla_bench.py model /tmp/dsv2lite > "$out/mla-model.log" 2>&1
for backend in TRITON_MLA FLASHINFER_MLA; do
  timeout 60 python3 -m kvllm.entrypoints.cli.main bench throughput /tmp/dsv2lite --load-format dummy \
    --attention-backend "$backend" --dtype bfloat16 --max-model-len 2048 --input-len 256 --output-len 64 \
    --num-prompts 64 --output-json "$out/e2e-$backend.json" > "$out/e2e-$backend.log" 2>&1
  echo "$backend e2e rc=$?" >> "$out/e2e-rc.txt"
done

echo "== tests"; grep -E '(passed|failed|error)' "$out/mla-tests.log" | tail -1; grep -E '^(FAILED|ERROR) ' "$out/mla-tests.log" | head -20
echo "== kernels"; tail -13 "$out/mla-kernels.log"
echo "== e2e"; cat "$out/e2e-rc.txt"; for f in "$out"/e2e-*.log; do echo "$f"; grep -iE "throughput|error|tok/s" "$f" | tail -3; done
