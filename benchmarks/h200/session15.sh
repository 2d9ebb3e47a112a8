#!/usr/bin/env bash
# The fifteenth session's GPU calls, on whichever card comes (raw results under /tmp/<phase>/, tarred into
# $OUT/<phase>.tgz after every step; a short table on stdout). docs/benchmarks.md, "H100, fifteenth session".
#   a  (carry [".vllm/part1"], so that an H200 can go on to `session14.sh b` and `c`, vLLM's parts 2 and 3, in
#      the next two calls on the same warm machine):
#      - every card: the GPU tests of the q_out hand-over (b607b33: the fused RoPE kernel writes q straight
#        into the piecewise graphs' shared query buffer): the layer-op kernel tests (kv_write, q_out
#        included) and the graphs-vs-eager test judged against HF float32 for TRITON_ATTN;
#      - H200: vLLM's first part, then the decode-plan sweep (decode_plan_sweep.py: the plan session14.sh b
#        reads);
#      - other cards: nano-vllm after a warm-up run, under the profiler (no direct_copy kernel should be left
#        in the piecewise steps; the q copy was 504 kernels, 22.7 ms, in the fourteenth session's `f`).
#   p  (probe, carry nothing): which profilers the machine has; the whole-model layer-op test under the HF
#      judge; FLEX_ATTENTION's build() host time and profile (flex_build_probe.py); with ncu, the W4A16 and
#      bf16 GEMVs on qkv and gate_up (w4a16_one_shape.py) under `ncu --set full`.
#   w  (carry nothing): the W4A16 GEMV's split K (issue 22): its GPU tests, the M = 1 sweep with split-K
#      candidates writing a tuned-config table, then the Llama-3-8B-shaped e2e (bf16, AWQ) and AWQ again with
#      that table (KVLLM_W4A16_GEMV_CONFIGS), under the profiler.
#   w2 (carry nothing): the same after `paired` (two weight streams per program for plain projections): tests,
#      sweep and table, then bf16 and AWQ with the table, both under the profiler.
#   b1 (carry nothing): batch-1 decode with its KV split into segments (the graph default, sized for
#      max_model_len) against one unsplit launch (KVLLM_TRITON_DECODE_PLAN=1:64,2,2,1), alternating twice, with
#      step profiles at context 128 and 3,968; then AWQ at batch 1 unsplit.
#   n  (carry nothing): ncu's warp-state detail (stall reasons) for the W4A16 GEMV's paired default and its
#      split-K / one-stream alternatives on qkv and gate_up.
#   v  (carry nothing): the W4A16 GPU tests at the final defaults (paired at one row) and the quantized-model
#      tests; on an H200 also its tuned table and the e2e with it.
#   w3 (carry nothing): the sweep with no-prefetch twins (the table now records prefetch), then AWQ's e2e
#      with that table.
#   w4 (carry nothing; not run yet): the W4A16 GEMV's next candidates (`--set next`: flat_tile, paired with
#      split K, on the 16-byte copies restored after the last call), then AWQ's e2e with that table.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session15.sh a|p|w|w2|b1|n|v|w3|w4}
default_budget_s=${DEFAULT_BUDGET_S:-570}
source benchmarks/h200/session_lib.sh
plan_file=/tmp/session14-plan.txt

case "$phase" in
a)
  parallel_tests 100 "ops|tests/gpu/test_layer_ops_gpu.py" "graphs|tests/gpu/test_cuda_graphs_gpu.py -k TRITON_ATTN"
  if grep -q H200 "$d/gpu.txt"; then
    run_step vllm-stage1 40 bash .vllm/part1/remote-stage.sh 1
    run_step sweep 330 python3 benchmarks/h200/decode_plan_sweep.py --out "$d/sweep.json" --plan-out "$d/plan.txt"
    grep -E '^\[b|^ {4}N|^plan' "$d/sweep.log"
    [ -s "$d/plan.txt" ] && cp "$d/plan.txt" "$plan_file"
  else
    bench warm 60 --engine kvllm --backend TRITON_ATTN --only nano --out "$d/warm"
    bench nano 110 --engine kvllm --backend TRITON_ATTN --only nano --step-log --profile-nano --out "$d/nano"
  fi
  ;;
p)
  run_step tools 10 bash -c 'which ncu nsys nvcc; ls -d /usr/local/cuda*/bin /opt/nvidia* 2>&1; true'
  cat "$d/tools.log"
  parallel_tests 100 "judge|tests/gpu/test_layer_ops_gpu.py -k model_bf16"
  run_step flex-build 90 python3 benchmarks/h200/flex_build_probe.py --out "$d"
  grep -E "build (alone|\+ sync)" "$d/flex-build.log"
  ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
  if [ -n "$ncu_bin" ]; then
    for shape in qkv gate_up; do
      run_step "ncu-$shape" 120 "$ncu_bin" --kernel-name regex:gemv --launch-skip 3 --launch-count 2 --set full \
        python3 benchmarks/h200/w4a16_one_shape.py --shape "$shape"
      grep -E "gemv|Throughput|Issue Slots|Warp Cycles Per Issued|Achieved Occupancy|Stall|Registers|L1/TEX Hit|L2 Hit|Eligible" \
        "$d/ncu-$shape.log" | head -n 60
    done
  fi
  ;;
w)
  parallel_tests 100 "quant|tests/gpu/test_quant_gpu.py -k 'split_k or gemv_matches or silu_and_mul'"
  run_step sweep 200 python3 benchmarks/h200/w4a16_gemv_m1.py --out "$d" --budget-s 140 \
    --table-out "$d/w4a16_gemv_configs.json"
  sed -n '/best per shape/,$p' "$d/sweep.log"; cat "$d/w4a16_gemv_configs.json"
  run_step e2e-base 150 python3 benchmarks/h200/quant_bench.py --out "$d/base" --parts e2e --engines bf16,awq --quick
  grep -h '"e2e"' "$d/e2e-base.log" | cut -c1-220
  KVLLM_W4A16_GEMV_CONFIGS=$d/w4a16_gemv_configs.json run_step e2e-tuned 100 python3 benchmarks/h200/quant_bench.py \
    --out "$d/tuned" --parts e2e --engines awq --quick --profile
  grep -h '"e2e"' "$d/e2e-tuned.log" | cut -c1-220
  ;;
w2)
  parallel_tests 100 "quant|tests/gpu/test_quant_gpu.py -k 'split_k or paired or gemv_matches or silu_and_mul'"
  run_step sweep 200 python3 benchmarks/h200/w4a16_gemv_m1.py --out "$d" --budget-s 150 \
    --table-out "$d/w4a16_gemv_configs.json"
  sed -n '/best per shape/,$p' "$d/sweep.log"; tr -d ' \n' < "$d/w4a16_gemv_configs.json"; echo
  KVLLM_W4A16_GEMV_CONFIGS=$d/w4a16_gemv_configs.json run_step e2e 200 python3 benchmarks/h200/quant_bench.py \
    --out "$d/e2e" --parts e2e --engines bf16,awq --quick --profile
  grep -h '"e2e"' "$d/e2e.log" | cut -c1-220
  ;;
b1)
  plan="1:64,2,2,1"  # batch 1 unsplit (default tiles): no segments, no reduce kernel
  bench warm 60 --engine kvllm --backend TRITON_ATTN --only latency --iters 2 --warmups 1 --out "$d/warm"
  for round in 1 2; do
    extra=(); [ $round = 1 ] && extra=(--profile-batches 1 --profile-long 1x3968)
    bench "split-$round" 70 --engine kvllm --backend TRITON_ATTN --only latency --iters 5 --warmups 2 \
      "${extra[@]}" --out "$d/split-$round"
    KVLLM_TRITON_DECODE_PLAN=$plan bench "unsplit-$round" 70 --engine kvllm --backend TRITON_ATTN --only latency \
      --iters 5 --warmups 2 "${extra[@]}" --out "$d/unsplit-$round"
  done
  KVLLM_W4A16_GEMV_CONFIGS=kvllm/layers/quantization/ops/w4a16_gemv_configs.json KVLLM_TRITON_DECODE_PLAN=$plan \
    run_step e2e-awq 90 python3 benchmarks/h200/quant_bench.py --out "$d/e2e" --parts e2e --engines awq --quick
  grep -h '"e2e"' "$d/e2e-awq.log" | cut -c1-200
  ;;
n)
  for spec in "qkv 4,1024,1,3,1,1" "qkv 8,1024,1,1,2,0" "gate_up 4,1024,1,3,1,1" "gate_up 8,1024,1,3,1,0"; do
    set -- $spec; tag="$1-${2//,/_}"
    run_step "ncu-$tag" 60 /usr/local/cuda/bin/ncu --kernel-name regex:w4a16 --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \
      --section LaunchStats --section SchedulerStats --print-details all \
      python3 benchmarks/h200/w4a16_one_shape.py --shape "$1" --config "$2"
    echo "== $tag"; grep -iE "Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Eligible Warps|Stall|stall|bank|Warp Cycles Per Issued" \
      "$d/ncu-$tag.log" | cut -c1-140 | head -n 40
  done
  ;;
v)
  parallel_tests 150 "quant|tests/gpu/test_quant_gpu.py -k 'gemv or paired or split_k or quantized_model or dispatch'"
  if grep -q H200 "$d/gpu.txt"; then  # the H200's own tuned table, then the e2e with it
    run_step sweep 150 python3 benchmarks/h200/w4a16_gemv_m1.py --out "$d" --budget-s 100 \
      --table-out "$d/w4a16_gemv_configs.json"
    sed -n '/best per shape/,$p' "$d/sweep.log"
    KVLLM_W4A16_GEMV_CONFIGS=$d/w4a16_gemv_configs.json run_step e2e 200 python3 benchmarks/h200/quant_bench.py \
      --out "$d/e2e" --parts e2e --engines bf16,awq --quick
    grep -h '"e2e"' "$d/e2e.log" | cut -c1-200
  fi
  ;;
w3)
  run_step sweep 120 python3 benchmarks/h200/w4a16_gemv_m1.py --out "$d" --budget-s 80 \
    --table-out "$d/w4a16_gemv_configs.json"
  sed -n '/best per shape/,$p' "$d/sweep.log"; tr -d ' \n' < "$d/w4a16_gemv_configs.json"; echo
  KVLLM_W4A16_GEMV_CONFIGS=$d/w4a16_gemv_configs.json run_step e2e 120 python3 benchmarks/h200/quant_bench.py \
    --out "$d/e2e" --parts e2e --engines awq --quick
  grep -h '"e2e"' "$d/e2e.log" | cut -c1-200
  ;;
w4)
  run_step sweep 150 python3 benchmarks/h200/w4a16_gemv_m1.py --out "$d" --budget-s 110 --set next \
    --table-out "$d/w4a16_gemv_configs.json"
  sed -n '/best per shape/,$p' "$d/sweep.log"; tr -d ' \n' < "$d/w4a16_gemv_configs.json"; echo
  KVLLM_W4A16_GEMV_CONFIGS=$d/w4a16_gemv_configs.json run_step e2e 120 python3 benchmarks/h200/quant_bench.py \
    --out "$d/e2e" --parts e2e --engines awq --quick
  grep -h '"e2e"' "$d/e2e.log" | cut -c1-200
  ;;
*)
  echo "unknown phase $phase (a|p|w|w2|b1|n|v|w3|w4)"; exit 2 ;;
esac
kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
save
since "done"
