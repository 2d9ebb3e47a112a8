#!/usr/bin/env bash
# MLA on the H200 in one device call, about 4 minutes (every step has its own timeout; one failing step
# never stops the next). FlashInfer is optional: with MLA_MODE=flashinfer and [".fi"] carried
# (../shared/gpu/stage-flashinfer.sh) its parts run (FLASHINFER_MLA tests, its decode kernel beside
# Triton's, its end-to-end runs) in place of the Triton sweep and Triton's eager end-to-end run.
# FlashInfer's ragged prefill is not used here (its FA3 module compiles for 71 s on a fresh machine):
# the end-to-end runs prefill with TORCH_SDPA, so they compare the decode backends alone.
#   1. tests/gpu/test_mla_gpu.py (bf16 unless MLA_DTYPES says more) against the float32 reference, and
#      without FlashInfer tests/gpu/test_fused_moe_gpu.py (the MoE alignment kernels are new);
#   2. mla_bench.py kernels: Triton's decode kernel (CUDA-graph timed) beside FlashInfer's, + the sweep;
#   3. mla_e2e.py: DeepSeek-V2-Lite-shaped dummy model, TRITON_MLA with CUDA graphs, then without (with
#      a host profile), or with FlashInfer: FLASHINFER_MLA with and without graphs.
# Everything goes to $OUT (or ./gpu-out): logs, JUnit XML, JSON; a short summary is printed last.
set -uo pipefail
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
out=${OUT:-gpu-out}; mkdir -p "$out"
# MLA_MODE=triton (default): no FlashInfer even if .fi is there; MLA_MODE=flashinfer: its parts (needs .fi).
has_fi=0
if [ "${MLA_MODE:-triton}" = flashinfer ]; then
  if [ -f .fi/unpack.sh ] && bash .fi/unpack.sh > "$out/fi-unpack.txt" 2>&1; then has_fi=1
  else echo "MLA_MODE=flashinfer but .fi/unpack.sh is missing or failed: Triton parts only" | tee "$out/fi-unpack.txt"; fi
fi
export PYTHONPATH=. FLASHINFER_WORKSPACE_BASE=/tmp/fiws TVM_FFI_CACHE_DIR=/tmp/tvmffi MAX_JOBS=16
[ $has_fi = 1 ] && export PYTHONPATH=.:/tmp/site-fi
export KVLLM_MLA_GPU_DTYPES=${MLA_DTYPES:-bfloat16}
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
step() {  # name timeout_s command...: run, log, record the exit status
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$? ${limit}s-limit $((SECONDS - t0))s" >> "$out/steps.txt"
}

# Two shapes of the run, each about 4 minutes: without FlashInfer, Triton's tests, kernel sweep and both
# end-to-end modes; with it, the FlashInfer tests and comparisons, Triton with graphs, no sweep.
if [ $has_fi = 1 ]; then
  tests_k="(FLASHINFER_MLA or graph) and not ragged"; tests_s=75; sweep_s=0
else
  tests_k="TRITON_MLA or split_counts or deepseek or fused_moe_gpu"; tests_s=85; sweep_s=35
fi
step mla-tests $tests_s python3 -m pytest tests/gpu/test_mla_gpu.py tests/gpu/test_fused_moe_gpu.py -m gpu -q -rfE -p no:cacheprovider -k "$tests_k" \
  --junitxml="$out/mla-junit.xml"
sweep_args=(); [ "$sweep_s" -gt 0 ] && sweep_args=(--sweep --budget-s "$sweep_s")
step mla-kernels $((45 + sweep_s)) python3 benchmarks/h200/mla_bench.py kernels "${sweep_args[@]}" \
  --out "$out/mla_kernels.json"
python3 benchmarks/h200/mla_bench.py model /tmp/dsv2lite > "$out/mla-model.log" 2>&1
e2e() {  # name limit backend extra-args...
  local name=$1 limit=$2 backend=$3; shift 3
  step "e2e-$name" "$limit" python3 benchmarks/h200/mla_e2e.py /tmp/dsv2lite --backend "$backend" \
    --prefill-backend TORCH_SDPA --num-prompts 32 --out "$out/e2e-$name.json" "$@"
}
e2e TRITON_MLA-graphs 40 TRITON_MLA
if [ $has_fi = 1 ]; then
  e2e FLASHINFER_MLA-graphs 35 FLASHINFER_MLA --force-graphs
  e2e FLASHINFER_MLA-eager 30 FLASHINFER_MLA --eager
else
  e2e TRITON_MLA-eager 30 TRITON_MLA --eager --profile-host
fi

echo "== steps (rc 124 = timeout)"; cat "$out/steps.txt"
echo "== tests"; grep -E '(passed|failed|error|skipped)' "$out/mla-tests.log" | tail -1; grep -E '^(FAILED|ERROR) ' "$out/mla-tests.log" | head -10
echo "== kernels"; sed -n '/^   H /,$p' "$out/mla-kernels.log" | head -30
echo "== e2e"; for f in "$out"/e2e-*.log; do echo "${f##*/}"; grep -E '^(init|warmup|batch1|throughput|graph replays) |Error|error' "$f" | tail -6; done
