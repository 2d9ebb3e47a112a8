#!/usr/bin/env bash
# The sixteenth session's GPU calls: vLLM 0.22 staged in three parts over three calls on one warm machine
# (each sent within 30 s of the last one's return; /tmp goes with the machine), whichever card comes, so that
# issue 17's table has vLLM beside kvllm on the same card. Raw results under /tmp/<phase>/, tarred into
# $OUT/<phase>.tgz after every step; a short table on stdout. docs/benchmarks.md, "sixteenth session".
# Staging here first: bash ../shared/gpu/vllm/stage-vllm.sh, then bash benchmarks/h200/split-vllm-parts.sh.
#   a  carry [".vllm/part1"]: vLLM's first piece; the W4A16 GEMV's GPU tests (paired, split K, the quantized
#      linear's dispatch), then `w4a16_gemv_m1.py --set next` (flat_tile, paired with split K, on the 16-byte
#      weight copies restored after the fifteenth session's last call) writing a tuned table, then AWQ's
#      Llama-3-8B-shaped batch-1 e2e with that table.
#   b  carry [".vllm/part2"]: the second piece; bf16's e2e on the same machine (the ratio's denominator), then
#      kvllm's graphs-vs-eager test for TRITON_ATTN (main on a GPU).
#   c  carry [".vllm/part3"]: the third piece; kvllm and vLLM 0.22 on issue 17's table (batch 1-256 latency,
#      nano-vllm with kvllm's kernel timeline, 256 x 128/128), one process each.
#   d  carry [".so-lite"] (after c, on the same machine: vLLM is still in /tmp/site-vllm): issue 19's batch-64
#      structured-outputs bench, kvllm then vLLM.
#   e  carry nothing: is a decode step GPU- or host-bound (decode_graph_probe.py: the engine's decode graph
#      replayed alone beside the step's wall time, and its kernels under the profiler at batch 1); the W4A16
#      GPU tests again with the cap `a` lacked, under the table `a` wrote (now shipped).
#   f  (ran at f28b7f0, whose norm_gemv is reverted since: no gain) carry nothing: the pre-norms fused into the
#      qkv / gate_up GEMV (norm_gemv): its GPU tests, the
#      graphs-vs-eager and whole-model tests under the HF judge, batch 1-256 latency with KVLLM_NORM_GEMV=1 / 0
#      alternating twice, and the decode graph alone at batch 1 and 8 (decode_graph_probe.py).
#   g  carry [".so-lite"]: where the host's time goes: a batch-1 latency run under cProfile
#      (fast_path_bench.py --cprofile-bs1) and the batch-64 structured-outputs bench, host clock and one run
#      of each arm under cProfile.
#   h  carry [".ab"] (.ab/flex_attention_impl_before.py: git show 20d19dc~1:kvllm/attention/backends/flex_attention_impl.py):
#      FLEX_ATTENTION's fresh prefills without the zeroed copies: its GPU tests (and the W4A16 paired / dispatch
#      tests under the flat_tile default), the FLEX rows after and before on decode 256 x 1k and prefill
#      8 x 2048 / 8 x 2000, then the W4A16 GEMV's `--set warps` sweep.
#   i  carry nothing: the fresh-prefill GPU test fixed after `h` (its step fit max_model_len), the quantized
#      linear's dispatch tests, and AWQ's batch-1 e2e beside bf16 under the table `h` wrote (now shipped).
#   k  carry [".so-lite"]: the grammar process with its sampling deferred to the next step's start (the
#      engine thread schedules while the process fills the masks): the structured-outputs GPU tests, then
#      the batch-64 bench with --grammar-process and without, alternating twice.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session16.sh a|b|c|d|e|f|g|h|i|k}
default_budget_s=${DEFAULT_BUDGET_S:-570}
source benchmarks/h200/session_lib.sh

case "$phase" in
a)
  run_step vllm-stage1 40 bash .vllm/part1/remote-stage.sh 1
  parallel_tests 90 "quant|tests/gpu/test_quant_gpu.py -k 'paired or split_k or dispatch or gemv_matches'"
  run_step sweep 160 python3 benchmarks/h200/w4a16_gemv_m1.py --out "$d" --budget-s 120 --set next \
    --table-out "$d/w4a16_gemv_configs.json"
  sed -n '/best per shape/,$p' "$d/sweep.log"; tr -d ' \n' < "$d/w4a16_gemv_configs.json"; echo
  cp "$d/w4a16_gemv_configs.json" /tmp/session16-w4a16.json 2>/dev/null
  KVLLM_W4A16_GEMV_CONFIGS=$d/w4a16_gemv_configs.json run_step e2e-awq 120 python3 benchmarks/h200/quant_bench.py \
    --out "$d/e2e-awq" --parts e2e --engines awq --quick
  grep -h '"e2e"' "$d/e2e-awq.log" | cut -c1-200
  ;;
b)
  run_step vllm-stage2 40 bash .vllm/part2/remote-stage.sh 2
  run_step e2e-bf16 120 python3 benchmarks/h200/quant_bench.py --out "$d/e2e-bf16" --parts e2e --engines bf16 --quick
  grep -h '"e2e"' "$d/e2e-bf16.log" | cut -c1-200
  if [ -s /tmp/session16-w4a16.json ]; then
    KVLLM_W4A16_GEMV_CONFIGS=/tmp/session16-w4a16.json run_step e2e-awq 120 python3 benchmarks/h200/quant_bench.py \
      --out "$d/e2e-awq" --parts e2e --engines awq --quick
    grep -h '"e2e"' "$d/e2e-awq.log" | cut -c1-200
  fi
  parallel_tests 110 "graphs|tests/gpu/test_cuda_graphs_gpu.py -k TRITON_ATTN"
  ;;
c)
  issue17_beside_vllm
  ;;
d)
  issue19_beside_vllm
  ;;
e)
  run_step probe 150 python3 benchmarks/h200/decode_graph_probe.py --out "$d"
  grep -h '^{' "$d/probe.log" | cut -c1-330
  parallel_tests 200 "quant|tests/gpu/test_quant_gpu.py -k 'paired or split_k or dispatch or gemv_matches'"
  ;;
f)
  parallel_tests 150 "norm|tests/gpu/test_gemv_gpu.py -k norm" "graphs|tests/gpu/test_cuda_graphs_gpu.py -k TRITON_ATTN" \
    "ops|tests/gpu/test_layer_ops_gpu.py -k model"
  for round in 1 2; do
    for arm in fused unfused; do
      flag=1; [ "$arm" = unfused ] && flag=0
      KVLLM_NORM_GEMV=$flag bench "latency-$arm-$round" 60 --engine kvllm --backend TRITON_ATTN --only latency \
        --iters 5 --warmups 2 --out "$d/latency-$arm-$round"
    done
  done
  run_step probe 100 python3 benchmarks/h200/decode_graph_probe.py --out "$d" --batches 1,8
  grep -h '^{' "$d/probe.log" | cut -c1-330
  ;;
g)
  bench cprofile 90 --engine kvllm --backend TRITON_ATTN --only latency --iters 3 --warmups 2 --cprofile-bs1 \
    --out "$d/cprofile"
  if stage_structured_outputs; then
    (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok
     run_step so-bench 150 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer /tmp/so-tok \
       --repeats 2 --host-clock --cprofile-dir "$d/so-cprofile" --out "$d/structured_outputs.json"
     tail -n 1 "$d/so-bench.log")
  fi
  head -n 30 "$d"/cprofile/cprofile-latency.txt 2>/dev/null | cut -c1-160
  ;;
h)
  parallel_tests 150 "flex|tests/gpu/test_flex_attention_gpu.py -k 'fresh or decode_only'" \
    "quant|tests/gpu/test_quant_gpu.py -k 'paired or dispatch'"
  flex_rows() {
    run_step "flex-$1" 90 python3 -m kvllm.benchmarks.attention --backends FLEX_ATTENTION --peers flex,sdpa \
      --only-shapes --shape "decode b256 x ctx1k:256x1@1023" --shape "prefill 8x2048 causal:8x2048@0" \
      --shape "prefill 8x2000 causal:8x2000@0" --output-json "$d/flex-$1.json"
    grep -E "FLEX_ATTENTION|flex|sdpa" "$d/flex-$1.log" | grep -v skipped | head -n 9
  }
  flex_rows after
  cp kvllm/attention/backends/flex_attention_impl.py /tmp/flex_after.py
  cp .ab/flex_attention_impl_before.py kvllm/attention/backends/flex_attention_impl.py
  flex_rows before
  cp /tmp/flex_after.py kvllm/attention/backends/flex_attention_impl.py
  run_step sweep 110 python3 benchmarks/h200/w4a16_gemv_m1.py --out "$d" --budget-s 75 --set warps \
    --table-out "$d/w4a16_gemv_configs.json"
  sed -n '/best per shape/,$p' "$d/sweep.log"
  ;;
i)
  parallel_tests 80 "flex|tests/gpu/test_flex_attention_gpu.py -k a_step_of_fresh" \
    "quant|tests/gpu/test_quant_gpu.py -k 'dispatch or quantized_model'"
  run_step e2e-awq 80 python3 benchmarks/h200/quant_bench.py --out "$d/e2e-awq" --parts e2e --engines awq --quick
  run_step e2e-bf16 60 python3 benchmarks/h200/quant_bench.py --out "$d/e2e-bf16" --parts e2e --engines bf16 --quick
  grep -h '"e2e"' "$d"/e2e-*.log | cut -c1-200
  ;;
k)
  stage_structured_outputs || { since "no .so-lite"; exit 3; }
  export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok
  run_step so-tests 50 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_structured_outputs_gpu.py
  for arm in process thread process thread; do
    i=$((${i:-0} + 1)); flag=""; [ "$arm" = process ] && flag=--grammar-process
    run_step "so-$arm-$i" 40 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer /tmp/so-tok --repeats 2 \
      $flag --out "$d/so-$arm-$i.json"
    tail -n 1 "$d/so-$arm-$i.log"
  done
  ;;
*)
  echo "unknown phase $phase (a|b|c|d|e|f|g|h|i|k)"; exit 2 ;;
esac
kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
save
since "done"
