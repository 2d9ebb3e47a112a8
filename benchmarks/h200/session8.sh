#!/usr/bin/env bash
# The eighth session's H200 calls (one lease of about 1,100 s of device time), one phase per call, sent
# back to back on one warm machine. Raw results go under /tmp/<phase>/ as they come and are tarred into
# $OUT/<phase>.tgz after every step (a call cut short still returns what it did); a short table goes to
# stdout. Every step has its own time cap, clipped so the whole call ends before BUDGET_S (default 480 s).
#   final       carry [".vllm/part1"]: vLLM's part 1 onto the machine; the fp8 cache's two fp16 dot feeds;
#               kvllm's fast path (batch 1, TTFT, nano-vllm, 256 x 128/128, batch 1 again late), nano-vllm
#               with an fp8 KV cache; host time per decode step by batch size (issue 17); speculative
#               decoding with verification in CUDA graphs (issue 21); then the merged branches' GPU
#               tests side by side (fp8 dots, speculative graphs, Gemma 2 and FLEX under the bf16 judge,
#               W4A16 GEMV, the prefill kernel).
#   final-vllm  carry [".vllm/part2", ".so-lite"], sent within 30 s of `final`: structured outputs at
#               batch 64 (issue 19), then vLLM 0.22 through the same batch-1 and nano-vllm runs and the
#               speculative-decoding configurations, and vLLM's fp8 nano-vllm run if time is left.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session8.sh final|final-vllm}
default_budget_s=480
source benchmarks/h200/session_lib.sh

case "$phase" in
final)
  run_step vllm-stage1 40 bash .vllm/part1/remote-stage.sh 1
  # The fp8 cache's two fp16 dot feeds (kvllm/attention/ops/triton_unified_attention.py), then the
  # faster of them (checked against float32 by the bench before it times) for the fp8 engine run.
  KVLLM_FP8_ATTENTION_DOT=fp16 attention fp8-fp16 25 --kv-cache-dtype fp8_e4m3 --shape decode64:64x1@2048
  KVLLM_FP8_ATTENTION_DOT=fp16_registers attention fp8-fp16-registers 25 --kv-cache-dtype fp8_e4m3 \
    --shape decode64:64x1@2048
  fp8_dot=$(python3 - "$d" <<'PY'
import json, sys
best = {}
for mode, label in (("fp16", "fp8-fp16"), ("fp16_registers", "fp8-fp16-registers")):
    try:
        rows = json.load(open(f"{sys.argv[1]}/attn-{label}.json"))["rows"]
        best[mode] = sum(r["ms"] for r in rows) if rows and all(r["status"] == "ok" for r in rows) else None
    except (OSError, ValueError, KeyError):
        best[mode] = None
ok = {m: t for m, t in best.items() if t}
print(min(ok, key=ok.get) if ok else "fp16")
PY
)
  since "fp8 dots for the engine run: $fp8_dot"
  bench kvllm 170 --engine kvllm --backend TRITON_ATTN --only latency,ttft,nano,bs256,latency-late --iters 3 \
    --warmups 1 --step-log
  KVLLM_FP8_ATTENTION_DOT=$fp8_dot bench kvllm-fp8 50 --engine kvllm --backend TRITON_ATTN --only nano \
    --kv-cache-dtype fp8 --step-log
  # Host time per decode step by phase, batch 1 / 64 / 256 (outputs as LLM.generate builds them).
  run_step step-profile 55 python3 benchmarks/h200/step_profile.py --out "$d" --backend TRITON_ATTN \
    --batch-sizes 1,64,256 --steps 20 --output-kinds final_only --label session8
  tail -n 6 "$d/step-profile.log"
  run_step spec-decode 130 python3 benchmarks/h200/spec_decode_bench.py --out "$d"
  tail -n 8 "$d/spec-decode.log"
  # GPU tests side by side (correctness only: nothing is timed while they run).
  parallel_tests "${TESTS_CAP:-120}" \
    "fp8-dots|tests/gpu/test_triton_attention_gpu.py -k fp8" \
    "spec|tests/gpu/test_spec_decode_gpu.py" \
    "spec-kernel|tests/gpu/test_triton_attention_gpu.py -k 'verification or multi_token or graph_capture'" \
    "gemma2|tests/gpu/test_models_gpu.py -k gemma2" \
    "flex-engine|tests/gpu/test_engine_cuda.py -k FLEX" \
    "flex-kernel|tests/gpu/test_flex_attention_gpu.py -k 'decoding_kernel or fresh_prefills or many_pages or compile_count'" \
    "w4a16|tests/gpu/test_quant_gpu.py -k 'gemv or dispatch'" \
    "prefill|tests/gpu/test_triton_prefill_gpu.py"
  python3 benchmarks/h200/bf16_judge_report.py "$d" > "$d/judge-summary.txt" 2>&1; tail -n 12 "$d/judge-summary.txt"
  ;;
final-vllm)
  SO_TESTS_CAP=40 structured_outputs
  bash .vllm/part2/remote-stage.sh 2 > "$d/vllm-stage2.log" 2>&1 || { tail -n 5 "$d/vllm-stage2.log"; save; exit 3; }
  tail -n 3 "$d/vllm-stage2.log"
  (export PYTHONPATH=.:/tmp/site-vllm
   bench vllm 170 --engine vllm --only latency,nano --iters 2 --warmups 1
   run_step spec-decode-vllm 200 python3 benchmarks/h200/spec_decode_bench.py --out "$d" --vllm
   tail -n 6 "$d/spec-decode-vllm.log"
   (( end - $(date +%s) > 90 )) && bench vllm-fp8 80 --engine vllm --only nano --kv-cache-dtype fp8)
  ;;
esac
kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
save
since "done"
