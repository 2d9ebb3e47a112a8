#!/usr/bin/env bash
# The GPU calls of the thirty-second session, each sent within 30 s of the last one's return. A call naming
# nvidia-h200 gets an H100 or an H200, and the card is known only once it runs, so `first` picks its work by
# the card. .ab/llm_engine_before.py is main's engine before the grammar thread (git show 4a2f526:kvllm/engine/
# llm_engine.py), .ab/triton_attn_impl_before.py the decode order before bd43b61 (see session30.sh). The grammar
# thread (dd10153, 7a8a099) lost on the H200 and was taken out: main's engine is the "before" arm again, so
# grammar_thread_ab now compares a file with itself (an A/A) unless .ab holds another arm.
#   first  carry [".so-lite", ".ab"], BUDGET_S=560:
#          on an H200 (about 8 minutes): issue 23's two missed decode rows timed graph and bench, issue 19's
#          A/B of the grammar thread (four arms), the batch-64 decode graph's launch on the host's clock, then
#          GPU tests side by side (bf16 greedy against HF, the decode order sorted on the host, graphs against
#          eager, structured outputs) as the budget allows; then `quant` within 30 s;
#          on an H100: `h100`
#   h100   carry [".so-lite", ".ab"]: the decode order's and the grammar thread's GPU tests, the batch-64 decode
#          graph's launch on the host's clock, then issue 19's A/B of the grammar thread (four arms)
#   quant  carry [".so-lite", ".ab"], BUDGET_S=540, meant for the H200: issue 22's GEMV sweep and AWQ end to end
#          (session31.sh quant without its structured-outputs runs), then the grammar thread's A/B (`SO_AB_ARMS`,
#          four arms unless set; "" for none)
#   *      = session31.sh's phases
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session32.sh first|h100|quant|<session31.sh phase>}
default_budget_s=${DEFAULT_BUDGET_S:-420}

grammar_thread_ab() {  # arms...: the batch-64 bench with the masks filled on the engine's thread (before) or
  # on the grammar thread during the launch (after)
  if stage_structured_outputs; then
    (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok SO_FILES=kvllm/engine/llm_engine.py
     so_ab "$@")
  fi
}
gpu_tests() {  # cap: the decode order's GPU tests (TRITON_ATTN's kernel, graphs against eager) and the
  # structured outputs' (the grammar thread on a GPU), side by side
  stage_structured_outputs
  PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok parallel_tests "$1" \
    "attn|tests/gpu/test_triton_attention_gpu.py tests/gpu/test_host_copy_gpu.py" \
    "graphs|tests/gpu/test_cuda_graphs_gpu.py -k TRITON_ATTN" \
    "so|tests/gpu/test_structured_outputs_gpu.py"
}
launch_probe() {  # the batch-64 decode graph replayed: device ms and the launch's host us
  run_step launch-probe 90 python3 benchmarks/h200/decode_graph_probe.py --out "$d/launch" --batches 64 --profile ""
  grep -h '^{' "$d/launch-probe.log" | cut -c1-200
}

case "$phase" in
first)
  source benchmarks/h200/session_lib.sh
  if ! on_h200; then
    end_phase
    exec env BUDGET_S=$(( end - $(date +%s) )) bash benchmarks/h200/session32.sh h100
  fi
  decode_rows graph bench
  grammar_thread_ab ${SO_AB_ARMS:-before after after before}
  launch_probe
  PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok parallel_tests 150 \
    "greedy|tests/gpu/test_engine_cuda.py -k 'not FLASHINFER and not FLASH_ATTN'" \
    "attn|tests/gpu/test_triton_attention_gpu.py tests/gpu/test_host_copy_gpu.py" \
    "graphs|tests/gpu/test_cuda_graphs_gpu.py -k TRITON_ATTN" \
    "so|tests/gpu/test_structured_outputs_gpu.py"
  end_phase
  ;;
h100)
  source benchmarks/h200/session_lib.sh
  gpu_tests 150
  launch_probe
  grammar_thread_ab ${SO_AB_ARMS:-before after after before}
  end_phase
  ;;
quant)
  source benchmarks/h200/session_lib.sh
  gemv_sweep_and_e2e
  grammar_thread_ab ${SO_AB_ARMS-before after after before}
  end_phase
  ;;
*)
  exec bash benchmarks/h200/session31.sh "$phase" ;;
esac
