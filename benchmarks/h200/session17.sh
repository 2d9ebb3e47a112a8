#!/usr/bin/env bash
# The seventeenth session's GPU calls. The card decides: on an H200 (none came in the fourteenth to sixteenth
# sessions) vLLM 0.22 is staged in three parts over three calls on one warm machine (each sent within 30 s of
# the last one's return; /tmp goes with the machine) for issue 17's and 19's tables beside it on that card;
# on an H100 those tables exist (sixteenth session) and the call measures what changed since instead.
# Raw results under /tmp/<phase>/, tarred into $OUT/<phase>.tgz after every step; a short table on stdout.
#   a  carry [".vllm/part1", ".so-lite"]: on an H200, vLLM's first piece and main's batch 1-256 latency (issue 17's
#      first rows, before the heavy runs of c). On an H100 (ran: the first call): the grammar process with its
#      sampling deferred to the next step's start against the engine thread, alternating twice (issue 19).
#      Then, on any card, FLEX_ATTENTION's decode 256 x 1k and prefill 8 x 2048 rows timed with `--timing
#      queued` (host out of the loop) and do_bench (issue 23).
#   b  carry [".vllm/part2"] (H200 only): vLLM's second piece; AWQ's Llama-3-8B-shaped batch-1 e2e beside bf16's
#      (issue 22; the H200 has no tuned W4A16 table, so its configs are default_config's).
#   c  carry [".vllm/part3"]: the third piece; kvllm and vLLM 0.22 on issue 17's table (batch 1-256 latency,
#      nano-vllm with kvllm's kernel timeline, 256 x 128/128), one process each.
#   d  carry [".so-lite"] (after c, on the same machine: vLLM is still in /tmp/site-vllm): issue 19's batch-64
#      structured-outputs bench, kvllm then vLLM.
#   e  carry [".so-lite", ".ab"], any card: where FLEX_ATTENTION's fresh prefill loses to torch's compiled FlexAttention
#      (flex_prefill_probe.py: the kernel alone on the backend's inputs, contiguous, with kernel options, and the
#      peer's layout), then batch-64 structured outputs on the engine thread (issue 19): the grammar's
#      termination kept beside its matcher against asking xgrammar each step (carry ".ab" too: .ab/request_before.py: git show 8936cb7~1:kvllm/structured_output/request.py), alternating twice.
#   h  carry nothing, an H200 with too little device time left for vLLM's three calls: kvllm alone on issue 17's
#      table (against the vLLM 0.22 numbers of earlier H200 leases), AWQ beside bf16 at batch 1 (issue 22) and
#      the FLEX rows (issue 23).
#   f  carry nothing, any card, when little device time is left: e's FLEX parts only.
#   x  carry [".so-lite", ".ab"]: h on an H200, else e (whichever card a call gets).
#   y  carry [".vllm/part1", ".so-lite", ".ab"] (the eighteenth session's first call): a on an H200, so that b, c
#      and d can follow on the same machine; else e.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session17.sh a|b|c|d|e|f|h|x|y}
default_budget_s=${DEFAULT_BUDGET_S:-570}
source benchmarks/h200/session_lib.sh

phase_e() {
  flex_rows queued
  run_step flex-probe 170 python3 benchmarks/h200/flex_prefill_probe.py --out "$d"
  sed -n '/^row /,$p' "$d/flex-probe.log"
  if stage_structured_outputs; then
    (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok
     if [ -f .ab/request_before.py ]; then  # the termination kept beside the matcher, against asking xgrammar
       req=kvllm/structured_output/request.py
       cp "$req" /tmp/request_after.py
       i=0
       for arm in before after before after; do
         i=$((i + 1))
         if [ "$arm" = before ]; then cp .ab/request_before.py "$req"; else cp /tmp/request_after.py "$req"; fi
         run_step "so-$arm-$i" 45 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer /tmp/so-tok \
           --repeats 2 --out "$d/so-$arm-$i.json"
         tail -n 1 "$d/so-$arm-$i.log"
       done
       cp /tmp/request_after.py "$req"
     fi)
  fi
}
phase_h() {
  bench kvllm 150 --engine kvllm --backend TRITON_ATTN --only latency,nano,bs256 --iters 3 --warmups 2 \
    --profile-nano --out "$d/kvllm"
  run_step e2e-awq 90 python3 benchmarks/h200/quant_bench.py --out "$d/e2e-awq" --parts e2e --engines awq --quick
  run_step e2e-bf16 70 python3 benchmarks/h200/quant_bench.py --out "$d/e2e-bf16" --parts e2e --engines bf16 --quick
  grep -h '"e2e"' "$d"/e2e-*.log | cut -c1-200
  flex_rows
}

case "$phase" in
a)
  if on_h200; then
    h200_first
  else
    so_pairs
  fi
  flex_rows
  ;;
b)
  run_step vllm-stage2 40 bash .vllm/part2/remote-stage.sh 2
  run_step e2e-awq 100 python3 benchmarks/h200/quant_bench.py --out "$d/e2e-awq" --parts e2e --engines awq --quick
  run_step e2e-bf16 80 python3 benchmarks/h200/quant_bench.py --out "$d/e2e-bf16" --parts e2e --engines bf16 --quick
  grep -h '"e2e"' "$d"/e2e-*.log | cut -c1-200
  ;;
c)
  issue17_beside_vllm
  ;;
d)
  issue19_beside_vllm
  ;;
e)
  phase_e
  ;;
h)
  phase_h
  ;;
x)
  if on_h200; then phase_h; else phase_e; fi
  ;;
y)
  if on_h200; then
    h200_first
    flex_rows
  else
    phase_e
  fi
  ;;
f)
  flex_rows queued
  run_step flex-probe 170 python3 benchmarks/h200/flex_prefill_probe.py --out "$d"
  sed -n '/^row /,$p' "$d/flex-probe.log"
  ;;
*)
  echo "unknown phase $phase (a|b|c|d|e|f|h|x|y)"; exit 2 ;;
esac
kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
save
since "done"
