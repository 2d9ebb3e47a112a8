#!/usr/bin/env bash
# The ninth session's H200 calls (one lease, up to four calls sent back to back on one warm machine). Raw
# results go under /tmp/<phase>/ and are tarred into $OUT/<phase>.tgz after every step; a short table goes to
# stdout. Every step has its own time cap, clipped so the whole call ends before BUDGET_S.
#   kvllm    carry [".vllm/part1"]: vLLM's part 1 onto the machine; batch-1 latency early and late with the
#            garbage collector's activity and a cProfile of each (the early runs are ~30 ms slower, issue
#            17); speculative decoding at batch 1 after the eighth session's host-work cuts, with a
#            torch.profiler table per configuration (issue 21); the W4A16 GEMV at M = 1 (issue 22); the
#            merged branches' GPU tests whose logs the eighth session lost.
#   vllm     carry [".vllm/part2", ".so-lite"], within 30 s of `kvllm`: structured outputs at batch 64 after
#            the mask-buffer rework (issue 19); vLLM 0.22 with an fp8 KV cache on nano-vllm (the peer of
#            kvllm's fp8 row) and vLLM's speculative configurations.
#   tests    carry [".stage_minilm1"]: W4A16 and fp8 end to end on Llama-3-8B shapes (issue 22); the GPU
#            test files not run on the merged code (TRITON_MLA's remaining cases, sleep mode, sampling,
#            Gemma 2 and FLEX under the bf16 judge, the Triton attention file).
#   encoder  carry [".stage_minilm2"]: the real all-MiniLM-L6-v2 and the BERT encoder on CUDA (issue 24).
#   verify   carry [".so-lite"], a second lease after the first's findings: structured outputs at batch 64
#            with the host's fill / accept / update timed, with xgrammar's threaded fill from 16 rows as an
#            A/B; batch 1 early and late with a host-CPU probe; TTFT and nano-vllm with the TRITON_ATTN
#            prefill kernel on by default, then off (A/B); the speculative GPU tests alone (in parallel,
#            engines ran out of GPU memory); structured-output and TRITON_MLA GPU tests.
#   verify2  carry [".so-lite"], the last of the budget: the speculative and MLA graph GPU tests after
#            their fixes (a fifth of the GPU per engine; MLA's kv heads = heads for HF), then structured
#            outputs at batch 64 with the grammars advanced ahead of the rest of the output work, twice
#            (the host is slow in the first minutes of a machine: the probe of the `verify` call).
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session9.sh kvllm|vllm|tests|encoder|verify|verify2}
default_budget_s=480
source benchmarks/h200/session_lib.sh

case "$phase" in
kvllm)
  run_step vllm-stage1 40 bash .vllm/part1/remote-stage.sh 1
  bench kvllm 100 --engine kvllm --backend TRITON_ATTN --only latency,latency-late --iters 3 --warmups 1 \
    --step-log --cprofile-bs1
  python3 - "$d/bench-kvllm.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("batch_size") == 1 and "latencies_s" in r:
        print(r["bench"], [round(x * 1e3, 1) for x in r["latencies_s"]], "ms; gc", r.get("gc"), "tracked", r.get("gc_tracked_objects"))
PY
  run_step spec-decode 150 python3 benchmarks/h200/spec_decode_bench.py --out "$d"
  tail -n 8 "$d/spec-decode.log"
  run_step w4a16-m1 70 python3 benchmarks/h200/w4a16_gemv_m1.py --out "$d" --budget-s 50
  tail -n 8 "$d/w4a16-m1.log"
  parallel_tests "${TESTS_CAP:-150}" \
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
vllm)
  SO_TESTS_CAP=40 structured_outputs
  bash .vllm/part2/remote-stage.sh 2 > "$d/vllm-stage2.log" 2>&1 || { tail -n 5 "$d/vllm-stage2.log"; save; exit 3; }
  tail -n 3 "$d/vllm-stage2.log"
  (export PYTHONPATH=.:/tmp/site-vllm
   bench vllm-fp8 150 --engine vllm --only nano --kv-cache-dtype fp8
   run_step spec-decode-vllm 230 python3 benchmarks/h200/spec_decode_bench.py --out "$d" --vllm
   tail -n 6 "$d/spec-decode-vllm.log")
  ;;
tests)
  bash .stage_minilm1/unpack.sh > "$d/minilm-stage1.log" 2>&1; tail -n 1 "$d/minilm-stage1.log"
  run_step quant-e2e 130 python3 benchmarks/h200/quant_bench.py --out "$d" --parts e2e \
    --engines bf16,awq,fp8-tensor --quick
  tail -n 8 "$d/quant-e2e.log"
  parallel_tests "${TESTS_CAP:-240}" \
    "mla|tests/gpu/test_mla_gpu.py -k TRITON_MLA" \
    "sleep|tests/gpu/test_sleep_mode_gpu.py" \
    "sampling|tests/gpu/test_sampling_gpu.py" \
    "triton-attn|tests/gpu/test_triton_attention_gpu.py -k 'not fp8 and not verification and not multi_token and not graph_capture'" \
    "graphs|tests/gpu/test_cuda_graphs_gpu.py" \
    "engine|tests/gpu/test_engine_cuda.py -k 'not FLEX'"
  python3 benchmarks/h200/bf16_judge_report.py "$d" > "$d/judge-summary.txt" 2>&1; tail -n 12 "$d/judge-summary.txt"
  ;;
encoder)
  bash .stage_minilm2/unpack.sh > "$d/minilm-stage2.log" 2>&1; tail -n 1 "$d/minilm-stage2.log"
  OUT=$d BUDGET_S=$(cap 200) bash benchmarks/h200/run_encoder.sh > "$d/encoder.log" 2>&1
  since "encoder (exit $?): $(grep -E 'passed|failed' "$d/encoder.log" | tail -n 1)"
  ;;
verify)
  tok=/tmp/so-tok; stage_structured_outputs || { since "carry .so-lite"; exit 3; }
  (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=$tok
   run_step so-bench 60 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer "$tok" --host-clock \
     --out "$d/structured_outputs.json"
   run_step so-bench-threaded16 60 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer "$tok" \
     --host-clock --threaded-fill-min-rows 16 --out "$d/structured_outputs-threaded16.json"
   grep -h '"host_ms_per_step"' -A4 "$d"/structured_outputs*.json | head -n 24)
  bench kvllm 130 --engine kvllm --backend TRITON_ATTN --only latency,ttft,nano,latency-late --iters 3 \
    --warmups 1 --step-log
  python3 - "$d/bench-kvllm.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("batch_size") == 1 and "latencies_s" in r:
        print(r["bench"], [round(x * 1e3, 1) for x in r["latencies_s"]], "ms; cpu probe", r.get("host_cpu_probe_ms"), r.get("host_cpu"))
PY
  KVLLM_TRITON_PREFILL_KERNEL=0 bench kvllm-unified-prefill 80 --engine kvllm --backend TRITON_ATTN --only ttft,nano \
    --step-log
  run_step tests-spec 90 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_spec_decode_gpu.py
  (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok
   run_step tests-so 70 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_structured_outputs_gpu.py)
  run_step tests-mla 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -o faulthandler_timeout=60 \
    tests/gpu/test_mla_gpu.py -k TRITON_MLA
  ;;
verify2)
  tok=/tmp/so-tok; stage_structured_outputs || { since "carry .so-lite"; exit 3; }
  run_step tests-spec 80 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_spec_decode_gpu.py
  grep -hE "^(FAILED|E  )" "$d/tests-spec.log" | head -n 8
  run_step tests-mla-graphs 60 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_mla_gpu.py \
    -k "graph_decode_matches_eager and TRITON_MLA"
  (export PYTHONPATH=.:/tmp/so-site
   for i in 1 2; do
     run_step so-bench-$i 50 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer "$tok" --host-clock \
       --out "$d/structured_outputs-$i.json"
   done)
  # Later sessions: add `--profile-dir "$d"` to one run for the device's idle share of a constrained step.
  ;;
esac
kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
save
since "done"
