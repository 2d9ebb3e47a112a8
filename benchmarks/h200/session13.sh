#!/usr/bin/env bash
# The thirteenth session's GPU calls. Raw results go under /tmp/<phase>/ and are tarred into $OUT/<phase>.tgz
# after every step; a short table goes to stdout.
# Staging here first: bash benchmarks/h200/stage-structured-outputs.sh (and, for `final`,
# bash ../shared/gpu/vllm/stage-vllm.sh).
#   diag  carry [".so-bench"]: issue 17's decode steps, where the nano-vllm workload's time goes.
#     - TRITON_ATTN's decode launch with its requests in batch order and longest first
#       (KVLLM_TRITON_DECODE_ORDER), on the uniform 256 x 1k shape and on ragged contexts like the workload's
#       (each request's context drawn from a range, in draw order);
#     - nano-vllm with each order, alternating twice, with the step log;
#     - nano-vllm under torch.profiler: its kernel timeline (busy and idle time, exclusive kernel time by
#       kind and by name: kernel_timeline.py), and step profiles at 256 x 1k, 128 x 512, 32 x 1k;
#     - issue 19, with what is left: one pair of the structured-outputs A/B (engine thread, grammar process).
#   diag2  carry nothing: what `diag` pointed at.
#     - nano-vllm's 18 mixed steps of 8192 tokens ran eagerly (piecewise graphs stopped at 2048 tokens) and took
#       22-50 ms each by the host's speed: nano-vllm with KVLLM_PIECEWISE_MAX_TOKENS 2048 and 8192 (the new
#       default), and 8192 with mid-size decode batches split (KVLLM_TRITON_SPLIT_POLICY=8,12), alternating twice;
#     - the split policy on the kernel alone: ragged batches of 48-128 requests (the workload's tail, where
#       one wave of programs does not fill the GPU), policies 2,4 (the default), 8,12 and 16,16.
#   vLLM's staged archive travels in three parts here (the tree grew to 9.8 MiB, and part 1 of the standard two,
#   58 MiB, no longer fits the 64 MiB a call carries): after stage-vllm.sh, bash benchmarks/h200/split-vllm-parts.sh
#   splits .vllm/part1's piece in two (part1: .0a, part2: .0b), moves the old part 2 to part3, and rewrites every
#   MANIFEST to list the three pieces.
#   final1  carry [".vllm/part1"]: vLLM's first piece onto the machine; the fused sampler's kernel timed alone
#     (its Philox now one call per four tokens) and its GPU tests.
#   final1b carry [".vllm/part2"], within 30 s of final1: the second piece; the GPU test of the ordered decode
#     launch on both page layouts (`layout` below settled NHD against HND: the same speed).
#   solo  carry nothing: what final1, final1b and final2 do for kvllm, in one call, without vLLM (three failed
#     machine starts left 564 s of device time, too little for vLLM's three staging calls and its start-up):
#     the sampler's kernel and GPU tests, the ordered launch's GPU test on both layouts, the nano pair NHD/HND,
#     then issue 17's table for kvllm with the faster layout.
#   final2  carry [".vllm/part3"], within 30 s of final1b: vLLM 0.22 and kvllm (default NHD pages)
#     on issue 17's table: batch 1-256 latency, nano-vllm, 256 x 128/128, GPU busy, one process each.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session13.sh diag|diag2|final1|final1b|final2|solo|layout}
default_budget_s=560
source benchmarks/h200/session_lib.sh

SHAPES=(
  --shape "decode b256 x ctx1k:256x1@1023"
  --shape "ragged b256 x 100-1100:256x1@100~1100"
  --shape "ragged b256 x 100-2047:256x1@100~2047"
  --shape "ragged b128 x 100-2047:128x1@100~2047"
  --shape "ragged b64 x 100-2047:64x1@100~2047"
)

case "$phase" in
diag)
  for order in batch longest_first; do
    KVLLM_TRITON_DECODE_ORDER=$order run_step "attn-$order" 60 python3 -m kvllm.benchmarks.attention \
      --backends TRITON_ATTN --peers triton --only-shapes "${SHAPES[@]}" --output-json "$d/attn-$order.json"
    grep -E "^\s+(TRITON_ATTN|triton)" "$d/attn-$order.log" | head -n 10
  done
  i=0
  for order in batch longest_first batch longest_first; do  # alternating: the host's speed drifts over a call
    i=$((i + 1))
    KVLLM_TRITON_DECODE_ORDER=$order bench "nano-$order-$i" 70 --engine kvllm --backend TRITON_ATTN \
      --only nano --step-log --out "$d/nano-$order-$i"
  done
  bench profile 120 --engine kvllm --backend TRITON_ATTN --only nano --profile-nano \
    --profile-long 256x1024,128x512,32x1024 --out "$d/profile"
  tok=/tmp/so-tok
  if stage_structured_outputs; then
    (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=$tok
     for mode in engine process; do
       extra=(); [ $mode = process ] && extra=(--grammar-process)
       run_step "so-$mode" 70 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer "$tok" \
         --repeats 2 --host-clock "${extra[@]}" --out "$d/structured_outputs-$mode.json"
       tail -n 1 "$d/so-$mode.log"
     done)
  fi
  ;;
diag2)
  for policy in 2,4 8,12 16,16; do
    KVLLM_TRITON_SPLIT_POLICY=$policy run_step "attn-split-$policy" 50 python3 -m kvllm.benchmarks.attention \
      --backends TRITON_ATTN --only-shapes --shape "ragged b48 x 100-2047:48x1@100~2047" \
      --shape "ragged b64 x 100-2047:64x1@100~2047" --shape "ragged b96 x 100-2047:96x1@100~2047" \
      --shape "ragged b128 x 100-2047:128x1@100~2047" --shape "decode b64 x ctx1k:64x1@1023" \
      --output-json "$d/attn-split-$policy.json"
    grep -E "^\s+TRITON_ATTN" "$d/attn-split-$policy.log" | head -n 5
  done
  for round in 1 2; do
    for variant in 2048:2,4 8192:2,4 8192:8,12; do
      cap_tokens=${variant%%:*} policy=${variant#*:}
      KVLLM_PIECEWISE_MAX_TOKENS=$cap_tokens KVLLM_TRITON_SPLIT_POLICY=$policy bench \
        "nano-$cap_tokens-$policy-$round" 60 --engine kvllm --backend TRITON_ATTN --only nano --step-log \
        --out "$d/nano-$cap_tokens-$policy-$round"
    done
  done
  ;;
final1)
  run_step vllm-stage1 40 bash .vllm/part1/remote-stage.sh 1
  run_step gumbel 40 python3 benchmarks/h200/gumbel_bench.py
  cat "$d/gumbel.log"
  run_step tests-sampling 40 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_sampling_gpu.py
  ;;
final1b)
  run_step vllm-stage2 40 bash .vllm/part2/remote-stage.sh 2
  run_step tests-ragged 40 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_triton_attention_gpu.py \
    -k ragged
  ;;
solo)
  run_step gumbel 30 python3 benchmarks/h200/gumbel_bench.py
  cat "$d/gumbel.log"
  parallel_tests 70 "sampling|tests/gpu/test_sampling_gpu.py" "ragged|tests/gpu/test_triton_attention_gpu.py -k ragged"
  for layout in NHD HND; do
    KVLLM_TRITON_KV_LAYOUT=$layout bench "nano-$layout-p0-$SECONDS" 45 --engine kvllm --backend TRITON_ATTN --only nano \
      --step-log --out "$d/nano-$layout-p0-$SECONDS"
  done
  layout=$(python3 benchmarks/h200/pick_arm.py "$d" NHD-p0 HND-p0 --margin 0)
  since "layout from the nano pair: $layout"
  KVLLM_TRITON_KV_LAYOUT=$layout bench kvllm 110 --engine kvllm --backend TRITON_ATTN --only latency,nano,bs256 \
    --iters 3 --warmups 2 --profile-nano --out "$d/kvllm"
  ;;
layout)  # the NHD/HND pair of `solo` again, after a warm-up run (a fresh machine's first nano run is slow)
  for layout in NHD NHD HND NHD HND; do
    KVLLM_TRITON_KV_LAYOUT=$layout bench "nano-$layout-p0-$SECONDS" 40 --engine kvllm --backend TRITON_ATTN --only nano \
      --step-log --out "$d/nano-$layout-p0-$SECONDS"
  done
  ;;
final2)
  bash .vllm/part3/remote-stage.sh 3 > "$d/vllm-stage3.log" 2>&1 || { tail -n 5 "$d/vllm-stage3.log"; save; exit 3; }
  tail -n 3 "$d/vllm-stage3.log"
  bench kvllm 110 --engine kvllm --backend TRITON_ATTN --only latency,nano,bs256 \
    --iters 3 --warmups 2 --profile-nano --out "$d/kvllm"
  (export PYTHONPATH=.:/tmp/site-vllm; bench vllm 220 --engine vllm --only latency,nano,bs256 --iters 3 \
    --warmups 2 --out "$d/vllm")
  ;;
esac
kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
save
since "done"
