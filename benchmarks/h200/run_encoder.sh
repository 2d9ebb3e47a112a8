#!/usr/bin/env bash
# GPU checks of the pooling runner (one device call): the BERT encoder through every GPU backend that
# declares encoder-only attention vs HF in float32 and bfloat16 (the others must refuse it), and the real
# all-MiniLM-L6-v2 on CUDA vs sentence-transformers' stored embeddings (needs /tmp/all-MiniLM-L6-v2, see
# stage_minilm.sh; skipped with the reason otherwise). Log, JUnit XML and encoder_gpu.json go to $OUT.
set -uo pipefail
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 KVLLM_GPU_REPORT_DIR=$out
[ -f /tmp/all-MiniLM-L6-v2/model.safetensors ] && export KVLLM_MINILM_PATH=/tmp/all-MiniLM-L6-v2
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader > "$out/env.txt" 2>&1
timeout "${BUDGET_S:-220}" python3 -m pytest -q -m gpu -rfEs -p no:cacheprovider --junitxml="$out/encoder-junit.xml" \
  tests/gpu/test_encoder_gpu.py > "$out/encoder-tests.log" 2>&1
rc=$?; tail -n 30 "$out/encoder-tests.log"; cat "$out/encoder_gpu.json" 2>/dev/null; exit $rc
