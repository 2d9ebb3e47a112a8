#!/usr/bin/env bash
# The fourteenth session's GPU calls: three calls on one warm machine, each sent within 30 s of the last
# one's return (the machine, and /tmp with it, goes back 30 s after a call). Raw results go under
# /tmp/<phase>/ and are tarred into $OUT/<phase>.tgz after every step; a short table goes to stdout.
# Staging here first: bash ../shared/gpu/vllm/stage-vllm.sh, then bash benchmarks/h200/split-vllm-parts.sh,
# and the sampler's previous kernel for the A/B: mkdir -p .ab && git show 5cafae2:kvllm/sample/gumbel.py
# > .ab/gumbel_before.py (.ab is ignored through .git/info/exclude).
#   a  carry [".vllm/part1", ".ab"]: vLLM's first piece; the sampler's kernel (a running best per lane,
#      reduced once) against the previous one, alternating, and the GPU sampling tests; then TRITON_ATTN's
#      decode launch over tiles x split counts x order on ragged batches of 8-256 requests, timed inside
#      CUDA graphs (decode_plan_sweep.py), which writes the KVLLM_TRITON_DECODE_PLAN of each size's fastest.
#   b  carry [".vllm/part2"]: the second piece; the graph-vs-eager GPU test under that plan; nano-vllm
#      default / plan alternating twice after a discarded warm-up run; the faster arm (pick_arm.py).
#   c  carry [".vllm/part3"]: the third piece; kvllm (with the faster arm) and vLLM 0.22 on issue 17's table:
#      batch 1-256 latency, nano-vllm (with kvllm's kernel timeline), 256 x 128/128, one process each.
#   e  carry nothing (a later call, any machine): the split decode launch's fused reduce
#      (KVLLM_TRITON_SPLIT_REDUCE=fused: the last segment program combines, no reduce kernel) against the
#      reduce kernel: its GPU tests, then batch 1-256 latency alternating twice (batch 1 and 8 split their KV).
#      It ran at d59ee42; the fused reduce was slower (batch 1 +9%) and is reverted, so `e` needs that commit.
#   f  carry nothing: the piecewise graphs without the k/v copy (a174db8): the graphs-vs-eager GPU test (HF
#      judge) for TRITON_ATTN, then nano-vllm after a warm-up run, under the profiler (its copies' time).
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session14.sh a|b|c|e|f}
default_budget_s=${DEFAULT_BUDGET_S:-570}
source benchmarks/h200/session_lib.sh
plan_file=/tmp/session14-plan.txt pick_file=/tmp/session14-pick.txt

case "$phase" in
a)
  run_step vllm-stage1 40 bash .vllm/part1/remote-stage.sh 1
  run_step gumbel 60 python3 benchmarks/h200/gumbel_bench.py --baseline .ab/gumbel_before.py
  grep '^{' "$d/gumbel.log"
  run_step tests-sampling 60 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_sampling_gpu.py
  run_step sweep 330 python3 benchmarks/h200/decode_plan_sweep.py --out "$d/sweep.json" --plan-out "$d/plan.txt"
  grep -E '^\[b|^ {4}N|^plan' "$d/sweep.log"
  [ -s "$d/plan.txt" ] && cp "$d/plan.txt" "$plan_file"
  ;;
b)
  run_step vllm-stage2 40 bash .vllm/part2/remote-stage.sh 2
  plan=$(cat "$plan_file" 2>/dev/null)
  since "plan: ${plan:-none (call a left no plan)}"
  if [ -n "$plan" ]; then
    KVLLM_TRITON_DECODE_PLAN=$plan parallel_tests 110 "graphs|tests/gpu/test_cuda_graphs_gpu.py -k TRITON_ATTN"
    arms=(warm default plan default plan)
  else
    arms=(warm default)
  fi
  i=0
  for arm in "${arms[@]}"; do
    i=$((i + 1))
    env_plan=""; [ "$arm" = plan ] && env_plan=$plan
    KVLLM_TRITON_DECODE_PLAN=$env_plan bench "nano-$arm-$i" 70 --engine kvllm --backend TRITON_ATTN --only nano \
      --step-log --out "$d/nano-$arm-$i"
  done
  python3 benchmarks/h200/pick_arm.py "$d" default plan > "$pick_file" 2> "$d/pick.log"
  cat "$d/pick.log"; since "faster arm: $(cat "$pick_file")"; cp "$pick_file" "$d/pick.txt"
  ;;
c)
  bash .vllm/part3/remote-stage.sh 3 > "$d/vllm-stage3.log" 2>&1 || { tail -n 5 "$d/vllm-stage3.log"; save; exit 3; }
  tail -n 3 "$d/vllm-stage3.log"
  env_plan=""
  [ "$(cat "$pick_file" 2>/dev/null)" = plan ] && env_plan=$(cat "$plan_file")
  since "kvllm with KVLLM_TRITON_DECODE_PLAN='$env_plan'"; echo "$env_plan" > "$d/plan-used.txt"
  KVLLM_TRITON_DECODE_PLAN=$env_plan bench kvllm 130 --engine kvllm --backend TRITON_ATTN --only latency,nano,bs256 \
    --iters 3 --warmups 2 --profile-nano --out "$d/kvllm"
  (export PYTHONPATH=.:/tmp/site-vllm; bench vllm 240 --engine vllm --only latency,nano,bs256 --iters 3 \
    --warmups 2 --out "$d/vllm")
  ;;
e)
  run_step tests-split 90 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_triton_attention_gpu.py \
    -k "split_kv or multi_token or graph"
  for round in 1 2; do
    for reduce in kernel fused; do
      KVLLM_TRITON_SPLIT_REDUCE=$reduce bench "latency-$reduce-$round" 60 --engine kvllm --backend TRITON_ATTN \
        --only latency --iters 5 --warmups 2 --out "$d/latency-$reduce-$round"
    done
  done
  ;;
f)
  parallel_tests 90 "graphs|tests/gpu/test_cuda_graphs_gpu.py -k TRITON_ATTN"
  bench warm 60 --engine kvllm --backend TRITON_ATTN --only nano --out "$d/warm"
  bench nano 110 --engine kvllm --backend TRITON_ATTN --only nano --step-log --profile-nano --out "$d/nano"
  ;;
*)
  echo "unknown phase $phase (a|b|c|e|f)"; exit 2 ;;
esac
kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
save
since "done"
