#!/usr/bin/env bash
# The eleventh session's H200 calls (one lease, four calls sent back to back on one warm machine). Raw results
# go under /tmp/<phase>/ and are tarred into $OUT/<phase>.tgz after every step; a short table goes to stdout.
# Staging here first: bash ../shared/gpu/vllm/stage-vllm.sh; bash benchmarks/h200/stage-structured-outputs.sh
# (.so-lite, with lm-format-enforcer for vLLM); bash ../shared/gpu/stage-flash-attn-4.sh;
# bash ../shared/gpu/stage-flashinfer.sh.
#   kvllm  carry [".vllm/part1"]: vLLM's part 1 onto the machine; W4A16 and bf16 end to end on Llama-3-8B shapes
#          with one batch-1 request of each under torch.profiler (issue 22: where the W4A16 step's time goes);
#          TRITON_ATTN's prefill kernel A/B on nano-vllm and TTFT, alternating (KVLLM_TRITON_PREFILL_KERNEL).
#   vllm   carry [".vllm/part2", ".so-lite"], within 30 s: vLLM 0.22's structured-outputs loss at batch 64 (the
#          peer of kvllm's; its run died on a missing lm-format-enforcer in the tenth session), then kvllm's
#          on the settled host, twice, and once with the host clock and a profile (issue 19).
#   fa1    carry [".stage1", ".fi"], within 30 s: FlashAttention-4's first part and FlashInfer onto the machine;
#          the structured-outputs GPU tests while at it (xgrammar is still in /tmp/so-site).
#   fa2    carry [".stage2"], within 30 s: benchmarks/h200/backends_session.sh (issue 23: the FLASHINFER and
#          FLASH_ATTN walks, FLEX_ATTENTION against its peers, auto-tune's table and its cache hit), then the
#          bf16 judge on FLASH_ATTN for the models with soft-cap, sliding window and sinks (issue 24).
# A second lease after the first's findings (W4A16's kernel times under programmatic dependent launch
# overlap, so its profile could not say where the step goes; auto-tune outlived its 50 s bound compiling;
# vLLM's constrained rows were judged 0 of 64 without a sample to say why; one Qwen3-MoE step on FLASH_ATTN
# over the judge's bound, where the CPU showed a router near-tie, a rule the judge now has; on the GPU it did
# not excuse the step, which stays failed). A third start ran only the W4A16 check after its launch change:
#   PYTHONPATH=. python3 benchmarks/h200/quant_bench.py --out $OUT/q --parts e2e --engines bf16,awq --quick --profile
#   kvllm2  carry [".vllm/part1"]: W4A16 and bf16 end to end again with KVLLM_PDL=0, profiled (clean kernel times).
#   vllm2   carry [".vllm/part2", ".so-lite"], within 30 s: vLLM's structured-outputs bench again, with sample texts.
#   fa1b    carry [".stage1"], within 30 s: FlashAttention-4's first part.
#   fa2b    carry [".stage2"], within 30 s: auto-tune on Qwen3-0.6B's shapes with room to compile (timed, then
#           the cache hit), and the FLASH_ATTN model judge again.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session11.sh kvllm|vllm|fa1|fa2|kvllm2|vllm2|fa1b|fa2b}
default_budget_s=480
source benchmarks/h200/session_lib.sh
FA_PATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages

case "$phase" in
kvllm)
  run_step vllm-stage1 40 bash .vllm/part1/remote-stage.sh 1
  run_step quant-e2e 170 python3 benchmarks/h200/quant_bench.py --out "$d" --parts e2e --engines bf16,awq \
    --quick --profile
  tail -n 6 "$d/quant-e2e.log"
  for f in "$d"/e2e-profile-*.txt; do [ -f "$f" ] && head -n 1 "$f"; done
  for kernel in 1 0 1 0; do  # alternating: the host's speed drifts over a call
    KVLLM_TRITON_PREFILL_KERNEL=$kernel bench "prefill$kernel-$SECONDS" 80 --engine kvllm --backend TRITON_ATTN \
      --only nano,ttft --step-log
  done
  ;;
vllm)
  tok=/tmp/so-tok; stage_structured_outputs || { since "carry .so-lite"; save; exit 3; }
  bash .vllm/part2/remote-stage.sh 2 > "$d/vllm-stage2.log" 2>&1 || { tail -n 5 "$d/vllm-stage2.log"; save; exit 3; }
  tail -n 3 "$d/vllm-stage2.log"
  # vLLM's own xgrammar first; lm-format-enforcer (imported by vLLM's request validation) from /tmp/so-site.
  (export PYTHONPATH=.:/tmp/site-vllm:/tmp/so-site
   run_step so-bench-vllm 230 python3 benchmarks/h200/structured_outputs_bench.py --engine vllm \
     --tokenizer "$tok" --out "$d/structured_outputs-vllm.json"
   tail -n 1 "$d/so-bench-vllm.log")
  (export PYTHONPATH=.:/tmp/so-site
   for i in 1 2; do
     run_step so-bench-$i 60 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer "$tok" \
       --out "$d/structured_outputs-$i.json"
     tail -n 1 "$d/so-bench-$i.log"
   done
   run_step so-bench-clocked 80 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer "$tok" \
     --host-clock --profile-dir "$d" --out "$d/structured_outputs-clocked.json"
   tail -n 1 "$d/so-bench-clocked.log")
  ;;
fa1)
  run_step fa4-stage1 30 bash .stage1/unpack.sh
  run_step fi-unpack 30 bash .fi/unpack.sh
  if [ -d /tmp/so-site/xgrammar ]; then
    (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok
     run_step tests-so 70 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_structured_outputs_gpu.py)
  fi
  ;;
fa2)
  (OUT=$d/backends timeout -k 10 "$(cap 330)" bash benchmarks/h200/backends_session.sh > "$d/backends.log" 2>&1)
  since "backends_session.sh (exit $?)"; tail -n 25 "$d/backends.log"; save
  (export PYTHONPATH=$FA_PATH KVLLM_GPU_REPORT_DIR=$d
   run_step tests-models-fa 220 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -o faulthandler_timeout=90 \
     tests/gpu/test_models_gpu.py -k FLASH_ATTN)
  grep -hE "^(FAILED|ERROR|SKIPPED)|passed|failed" "$d/tests-models-fa.log" | tail -n 12
  PYTHONPATH=. python3 benchmarks/h200/bf16_judge_report.py "$d" > "$d/judge-summary.txt" 2>&1
  tail -n 10 "$d/judge-summary.txt"
  ;;
kvllm2)
  run_step vllm-stage1 40 bash .vllm/part1/remote-stage.sh 1
  KVLLM_PDL=0 run_step quant-e2e-nopdl 170 python3 benchmarks/h200/quant_bench.py --out "$d" --parts e2e \
    --engines bf16,awq --quick --profile
  tail -n 4 "$d/quant-e2e-nopdl.log"
  for f in "$d"/e2e-profile-*.txt; do [ -f "$f" ] && head -n 1 "$f"; done
  ;;
vllm2)
  tok=/tmp/so-tok; stage_structured_outputs || { since "carry .so-lite"; save; exit 3; }
  bash .vllm/part2/remote-stage.sh 2 > "$d/vllm-stage2.log" 2>&1 || { tail -n 5 "$d/vllm-stage2.log"; save; exit 3; }
  (export PYTHONPATH=.:/tmp/site-vllm:/tmp/so-site
   run_step so-bench-vllm 230 python3 benchmarks/h200/structured_outputs_bench.py --engine vllm \
     --tokenizer "$tok" --out "$d/structured_outputs-vllm.json"
   tail -n 1 "$d/so-bench-vllm.log"
   grep -A3 '"sample_texts"' "$d/structured_outputs-vllm.json" | head -n 10)
  ;;
fa1b)
  run_step fa4-stage1 30 bash .stage1/unpack.sh
  ;;
fa2b)
  run_step fa4-stage2 40 bash .stage2/unpack.sh
  q06=/tmp/qwen3-0.6b-shapes; mkdir -p $q06
  python3 -c "import json; from kvllm.benchmarks.model_shapes import QWEN3_0_6B as c; print(json.dumps(c))" \
    > $q06/config.json
  export KVLLM_CACHE_DIR=/tmp/kvllm-autotune-cache
  for run in 1 2; do
    extra=(); [ $run = 1 ] && extra=(--retune)
    PYTHONPATH=$FA_PATH run_step autotune-$run $(( run == 1 ? 200 : 60 )) python3 -m kvllm.entrypoints.cli.main \
      backends $q06 --tune "${extra[@]}" --dtype bfloat16 --max-model-len 8192 --tune-time-cap 150 \
      --tune-json "$d/autotune-$run.json"
    grep -E "auto-tune|^(FLASH|TRITON|FLEX|CPU|backend)|Chosen" "$d/autotune-$run.log" | head -n 12
  done
  (export PYTHONPATH=$FA_PATH KVLLM_GPU_REPORT_DIR=$d
   run_step tests-models-fa 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -o faulthandler_timeout=90 \
     tests/gpu/test_models_gpu.py -k "FLASH_ATTN and (qwen3_moe or mixtral or gpt_oss)")
  PYTHONPATH=. python3 benchmarks/h200/bf16_judge_report.py "$d" > "$d/judge-summary.txt" 2>&1
  tail -n 17 "$d/judge-summary.txt"
  ;;
esac
kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
save
since "done"
