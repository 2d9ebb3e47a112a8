#!/usr/bin/env bash
# The eighteenth session's GPU calls (any card; the first call, session17.sh y, came on an H100 and measured
# the FLEX prefill probe and the grammar termination A/B). Raw results under /tmp/<phase>/, tarred into
# $OUT/<phase>.tgz after every step; a short table on stdout.
#   a  carry [".so-lite"]: issue 23's FLEX_ATTENTION without host syncs (the build's nonzero gone, the K/V
#      written by the Triton kernel, masks copied without waiting): the GPU tests of the paths it touches
#      (the new sync-debug-mode test included), the decode 256 x 1k and prefill 8 x 2048 rows timed
#      queued (and their build column), the prefill probe; then issue 19's batch-64 bench with the host clock and
#      cProfile on the engine thread (where a constrained step's host time goes now).
#   b  carry nothing (an H100), or [".vllm/part2"] (an H200, after p; vLLM's second piece staged first): issue
#      22's Llama-3-8B-shaped batch-1 AWQ beside bf16 with a torch.profiler kernel table each (where AWQ's
#      3.24 ms a token goes beyond the GEMVs).
#   p  carry [".vllm/part1", ".so-lite"], the first call on whichever card comes: a on an H100; on an H200
#      vLLM's first piece, then a's FLEX tests and queued rows only, so that b, then session17.sh c and d
#      (vLLM's third piece, issue 17's and 19's tables beside vLLM 0.22) follow on the same machine.
#   q  carry [".so-lite"], a first call with too little device time left for vLLM's pieces: a on an H100; on an
#      H200 a's FLEX tests and queued rows, then kvllm alone on issue 17's table (against the vLLM 0.22
#      numbers of earlier H200 leases).
#   c  carry [".so-lite", ".ab"]: issue 19's mask off the step's critical path (the masks' copy on a stream of its
#      own, overlapping the forward; the fused sampling pass reading the bitmask instead of a masked copy of
#      the logits): the batch-64 bench alternating after and before (.ab/{gumbel,sampler,model_runner}_before.py,
#      main before the change) as ABBA, then the structured-outputs and sampling GPU tests; then b's AWQ e2e
#      with its kernel tables if the device time allows.
#   s  carry [".vllm/part2"] (an H200, after p, when too little device time is left for b's AWQ runs as well as
#      session17.sh c and d): vLLM's second piece only.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session18.sh a|b|c|p|q|s}
default_budget_s=${DEFAULT_BUDGET_S:-570}
source benchmarks/h200/session_lib.sh

on_h200() { grep -q H200 "$d/gpu.txt"; }
flex_rows() {  # issue 23: FLEX_ATTENTION's rows, queued (host out of the loop) and do_bench
  for timing in ${@:-queued bench}; do
    run_step "flex-$timing" 80 python3 -m kvllm.benchmarks.attention --backends FLEX_ATTENTION --peers flex,sdpa \
      --only-shapes --shape "decode b256 x ctx1k:256x1@1023" --shape "prefill 8x2048 causal:8x2048@0" \
      --timing "$timing" --output-json "$d/flex-$timing.json"
    grep -E "^  (FLEX_ATTENTION|Flex|SDPA)" "$d/flex-$timing.log" | head -n 6 | cut -c1-250
    python3 -c "import json,sys; [print(r['shape'], 'build', r['build_ms'], 'without its sync',
      r['extra'].get('build_ms_without_sync'), 'sync alone', r['extra'].get('sync_alone_ms'))
      for r in json.load(open(sys.argv[1]))['rows'] if r['kernel'] == 'FLEX_ATTENTION' and r.get('build_ms')]" \
      "$d/flex-$timing.json"
  done
}

flex_tests() {
  parallel_tests "$1" "flex|tests/gpu/test_flex_attention_gpu.py -k 'never_waits or fresh or decode_only or test_dtypes or many_pages or float16_cache'"
}
phase_a() {
  flex_tests 150
  flex_rows queued
  run_step flex-probe 100 python3 benchmarks/h200/flex_prefill_probe.py --out "$d"
  sed -n '/^row /,$p' "$d/flex-probe.log"
  if stage_structured_outputs; then
    (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok
     run_step so-clock 80 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer /tmp/so-tok --repeats 2 \
       --host-clock --cprofile-dir "$d/so-cprofile" --out "$d/so-clock.json"
     tail -n 3 "$d/so-clock.log")
  fi
}

case "$phase" in
a)
  phase_a
  ;;
p)
  if on_h200; then
    run_step vllm-stage1 40 bash .vllm/part1/remote-stage.sh 1
    flex_tests 120
    flex_rows queued
  else
    phase_a
  fi
  ;;
b)
  if [ -d .vllm/part2 ]; then run_step vllm-stage2 40 bash .vllm/part2/remote-stage.sh 2; fi
  run_step e2e 240 python3 benchmarks/h200/quant_bench.py --out "$d/e2e" --parts e2e --engines awq,bf16 --quick \
    --profile
  grep -h '"e2e"' "$d/e2e.log" | cut -c1-200
  for f in "$d"/e2e/e2e-profile-*.txt; do echo "== $f"; head -n 30 "$f" | cut -c1-180; done
  ;;
q)
  if on_h200; then
    flex_tests 120
    flex_rows queued
    bench kvllm 150 --engine kvllm --backend TRITON_ATTN --only latency,nano,bs256 --iters 3 --warmups 2 \
      --profile-nano --out "$d/kvllm"
  else
    phase_a
  fi
  ;;
c)
  if stage_structured_outputs; then
    (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok
     so_ab ${SO_ARMS:-after before before after}  # ABBA: a fresh machine's first minutes run slow
     parallel_tests 80 "so|tests/gpu/test_structured_outputs_gpu.py tests/gpu/test_sampling_gpu.py")
  fi
  if (( end - $(date +%s) > 200 )); then
    run_step e2e 240 python3 benchmarks/h200/quant_bench.py --out "$d/e2e" --parts e2e --engines awq,bf16 --quick \
      --profile
    grep -h '"e2e"' "$d/e2e.log" | cut -c1-200
    for f in "$d"/e2e/e2e-profile-*.txt; do echo "== $f"; head -n 30 "$f" | cut -c1-180; done
  fi
  ;;
s)
  run_step vllm-stage2 40 bash .vllm/part2/remote-stage.sh 2
  ;;
*)
  echo "unknown phase $phase (a|b|c|p|q|s)"; exit 2 ;;
esac
kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
save
since "done"
