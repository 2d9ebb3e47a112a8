#!/usr/bin/env bash
# The nineteenth session's GPU calls (any card). Raw results under /tmp/<phase>/, tarred into $OUT/<phase>.tgz
# after every step; a short table on stdout. (The first call was session18.sh c.)
#   a  carry [".so-lite", ".ab"]: issue 22's short prefill (w4a16_prefill_probe.py: the dequantize launch's
#      shapes, and the Triton GEMM with split K at 32 and 64 rows, beside dequantize + cuBLAS), then issue 19's
#      batch-64 A/B of 89834d4 (.ab/{gumbel,sampler,model_runner}_before.py) for two more pairs, and one
#      constrained run of main under torch.profiler (the device's busy share and its kernels).
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: session19.sh a}
default_budget_s=${DEFAULT_BUDGET_S:-560}
source benchmarks/h200/session_lib.sh

so_ab() {  # arms...: the batch-64 structured-outputs bench with main's files, or 89834d4~1's for "before"
  local files="kvllm/sample/gumbel.py kvllm/sample/sampler.py kvllm/worker/model_runner.py" f i=0 arm
  for f in $files; do cp "$f" "/tmp/$(basename "$f" .py)_after.py"; done
  for arm in "$@"; do
    i=$((i + 1))
    for f in $files; do
      if [ "$arm" = before ]; then cp ".ab/$(basename "$f" .py)_before.py" "$f"; else cp "/tmp/$(basename "$f" .py)_after.py" "$f"; fi
    done
    run_step "so-$arm-$i" 45 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer /tmp/so-tok \
      --repeats 2 --out "$d/so-$arm-$i.json"
    tail -n 1 "$d/so-$arm-$i.log"
  done
  for f in $files; do cp "/tmp/$(basename "$f" .py)_after.py" "$f"; done
}

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
*)
  echo "unknown phase $phase (a)"; exit 2 ;;
esac
kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
save
since "done"
