#!/usr/bin/env bash
# Rechecks the two bf16-judge failures of the H200 session of 2026-12-01, in one call under 4 minutes:
#   models  Gemma 2 on TRITON_ATTN and FLEX_ATTENTION, judged against HF float32 run eager (HF's default
#           there ran Gemma 2 without its attention soft-cap); each report records HF's implementation
#   engine  FLEX_ATTENTION through the engine (greedy_bf16_vs_fp32): the default general path, and the
#           split path opted in (KVLLM_FLEX_SPLIT_PATH=1) with the decode BlockMask's kv_indices widened
#   flex    the split path's kernel tests (decoding kernel, fresh prefills beside decodes, long decodes
#           on both paths, the compile bound)
# Three pytest processes side by side on the one GPU. JSON reports and logs go to $OUT/gemma2_flex.tgz;
# the judge's per-prompt table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}; d=/tmp/gemma2_flex; mkdir -p "$out" "$d"
export PYTHONUNBUFFERED=1 PYTHONPATH=. KVLLM_GPU_REPORT_DIR=$d
started=$(date +%s)
since() { echo "[$(( $(date +%s) - started )) s] $*"; }
pytest_gpu() {  # $1 label, rest: pytest arguments
  local label=$1; shift
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --durations=8 "$@" > "$d/pytest-$label.log" 2>&1
  since "$label: $(tail -n 1 "$d/pytest-$label.log")"
}
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader > "$d/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> "$d/gpu.txt"
git log --oneline -1 >> "$d/gpu.txt" 2>/dev/null
# What transformers' default picks for Gemma 2 here (the reference now asks for eager explicitly).
python3 -c "from pathlib import Path; from tests import model_factory; from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(str(model_factory.make_tiny_gemma2(Path('/tmp/gemma2_default'))))
print('HF default attn_implementation for Gemma 2:', m.config._attn_implementation)" 2>&1 | tail -n 1 >> "$d/gpu.txt"
cat "$d/gpu.txt"
pytest_gpu models tests/gpu/test_models_gpu.py -k gemma2 &
pytest_gpu engine tests/gpu/test_engine_cuda.py -k FLEX &
pytest_gpu flex tests/gpu/test_flex_attention_gpu.py \
  -k "decoding_kernel or fresh_prefills or many_pages or compile_count" &
wait
grep -h -E "^(FAILED|ERROR)" "$d"/pytest-*.log | cut -c1-300
python3 benchmarks/h200/bf16_judge_report.py "$d" | tee "$d/summary.txt"
python3 -c "import glob, json; [print(f, json.load(open(f)).get('hf_attn_implementation')) for f in sorted(glob.glob('$d/models_*.json'))]"
tar czf "$out/gemma2_flex.tgz" -C /tmp gemma2_flex
since "done"
