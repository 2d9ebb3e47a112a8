#!/usr/bin/env bash
# The nineteenth session's GPU calls (any card). Raw results under /tmp/<phase>/, tarred into $OUT/<phase>.tgz
# after every step; a short table on stdout. (The first call was session18.sh c.)
#   a  carry [".so-lite", ".ab"]: issue 22's short prefill (w4a16_prefill_probe.py: the dequantize launch's
#      shapes, and the Triton GEMM with split K at 32 and 64 rows, beside dequantize + cuBLAS), then issue 19's
#      batch-64 A/B of 89834d4 (.ab/{gumbel,sampler,model_runner}_before.py) for two more pairs, and one
#      constrained run of main under torch.profiler (the device's busy share and its kernels).
#   b  carry [".so-lite", ".ab"]: issue 22's new W4A16 routes (the split-K GEMM up to 64 rows, the dequantize
#      launch's new shape): the Llama-3-8B-shaped batch-1 e2e, AWQ and bf16 with main (kernel tables), then AWQ
#      with .ab/w4a16_before.py (main before the change); the quantization GPU tests; the GEMM against
#      dequantize + cuBLAS at 128 rows (where the route changes). Then, time allowing, whether the sampling
#      kernel's bitmask arguments slow the unconstrained batch-64 run (89834d4's gumbel.py and sampler.py, ABBA).
#   c  carry [".ab"]: the sampling kernel alone, main's against 89834d4~1's (gumbel_bench.py --baseline), and
#      the W4A16 GEMM's GPU tests at 32, 64 and 256 rows (b's run of the whole file was cut at its cap after
#      the gather variant failed at 256 rows).
#   d  carry nothing (written after the session's device time was spent): issue 22's decode GEMV under
#      programmatic dependent launch (quant_bench.py's awq-pdl) against without, batch 1 e2e, ABBA, bf16 once.
#   e  carry [".so-lite", ".ab"] with .ab/{gumbel,sampler}_same.py (copies of main's files) beside the _before.py
#      ones: whether the unconstrained runs' 3-6% in "after" arms comes from copying the files in (after against
#      same: one code, two copies) or from the code (then before runs faster than both).
#   next  carry [".so-lite", ".ab"] (with e's files): d, then e if at least 170 s of BUDGET_S are left; for the
#      next session's first call on any card (on an H200, d's awq and bf16 rows are issue 22's ratio on its card).
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session19.sh a|b|c|d|e|next}
default_budget_s=${DEFAULT_BUDGET_S:-560}
source benchmarks/h200/session_lib.sh


case "$phase" in
a)
  run_step prefill-probe 200 python3 benchmarks/h200/w4a16_prefill_probe.py --out "$d/prefill" --budget-s 170
  sed -n '/^shape /,$p' "$d/prefill-probe.log"
  if stage_structured_outputs; then
    (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok
     so_ab before after after before
     run_step so-profile 60 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer /tmp/so-tok \
       --repeats 1 --profile-dir "$d/so-profile" --out "$d/so-profile.json"
     tail -n 2 "$d/so-profile.log"; grep -h "kernel time" "$d"/so-profile/*.txt)
  fi
  ;;
b)
  run_step e2e 160 python3 benchmarks/h200/quant_bench.py --out "$d/e2e" --parts e2e --engines awq,bf16 --quick \
    --profile
  grep -h '^e2e ' "$d/e2e.log"
  for f in "$d"/e2e/e2e-profile-*.txt; do echo "== $f"; head -n 1 "$f"; sed -n '/Self CUDA %/,$p' "$f" | sed -n 3,12p | cut -c1-60,150-230; done
  w=kvllm/layers/quantization/ops/w4a16.py
  cp "$w" /tmp/w4a16_after.py; cp .ab/w4a16_before.py "$w"
  run_step e2e-before 80 python3 benchmarks/h200/quant_bench.py --out "$d/e2e-before" --parts e2e --engines awq --quick
  cp /tmp/w4a16_after.py "$w"
  grep -h '^e2e ' "$d/e2e-before.log"
  parallel_tests 100 "quant|tests/gpu/test_quant_gpu.py"
  run_step crossover 75 python3 benchmarks/h200/w4a16_prefill_probe.py --out "$d/crossover" --rows 128 \
    --gemm-block-m 64 --dequant-default-only --budget-s 55
  sed -n '/^shape /,$p' "$d/crossover.log"
  if (( end - $(date +%s) > 110 )) && stage_structured_outputs; then
    (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok SO_FILES="kvllm/sample/gumbel.py kvllm/sample/sampler.py"
     so_ab after before before after)
  fi
  ;;
c)
  run_step gumbel 60 python3 benchmarks/h200/gumbel_bench.py --baseline .ab/gumbel_before.py
  tail -n 12 "$d/gumbel.log"
  run_step quant-tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_quant_gpu.py \
    -k "test_w4a16_matches_float32 and (-32- or -64- or -256-)"
  grep -E "^(FAILED|ERROR)|passed|failed" "$d/quant-tests.log" | head -n 30
  grep -m 3 -B 2 -A 12 "^E " "$d/quant-tests.log" | head -n 60
  ;;
d)
  gemv_pdl_ab
  ;;
e)
  sampling_files_aab
  ;;
next)
  gemv_pdl_ab
  if (( end - $(date +%s) > 170 )); then sampling_files_aab; fi
  ;;
*)
  echo "unknown phase $phase (a|b|c|d|e|next)"; exit 2 ;;
esac
kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
save
since "done"
