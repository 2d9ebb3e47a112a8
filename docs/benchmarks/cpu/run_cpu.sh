#!/usr/bin/env bash
# CPU results of docs/benchmarks.md: SmolLM2-135M-Instruct (the default model), kvllm beside HF
# transformers, float32, one torch thread. Throughput runs alternate kvllm / HF three times so the
# run-to-run noise shows next to the ratio. Run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
OUT=docs/benchmarks/cpu
lscpu > "$OUT/lscpu.txt"
kvllm() { .venv/bin/python -m kvllm.entrypoints.cli.main "$@"; }
for bs in 1 8; do
  kvllm bench latency --input-len 32 --output-len 32 --batch-size "$bs" --num-iters-warmup 2 --num-iters 5 \
    --output-json "$OUT/latency-smollm2-bs$bs.json"
done
for run in 1 2 3; do
  for backend in kvllm hf; do
    kvllm bench throughput --backend "$backend" --input-len 64 --output-len 32 --num-prompts 32 \
      --hf-max-batch-size 32 --output-json "$OUT/throughput-smollm2-$backend-run$run.json"
  done
done
