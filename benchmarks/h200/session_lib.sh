# Shared by the H200 session scripts (session7.sh, session8.sh): sourced from the repository root after
# the script sets `phase` and `default_budget_s`. Raw results go under /tmp/<phase>/ and are tarred into
# $OUT/<phase>.tgz after every step; every step's cap is clipped so the call ends before BUDGET_S.
# It also records the GPU, samples its clocks and times a host-CPU probe (the script kills $clocks_pid and
# $host_probe_pid at its end).
out=${OUT:-gpu-out}; d=/tmp/$phase; mkdir -p "$out" "$d"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
started=$(date +%s); end=$(( started + ${BUDGET_S:-$default_budget_s} ))
since() { echo "[$(( $(date +%s) - started )) s] $*"; }
cap() { local want=$1 left=$(( end - $(date +%s) - 15 )); (( left < want )) && want=$left; (( want < 1 )) && want=1; echo "$want"; }
save() { tar czf "$out/.$phase.$BASHPID.tgz" -C /tmp "$phase" && mv -f "$out/.$phase.$BASHPID.tgz" "$out/$phase.tgz"; }  # atomic: tests save side by side
run_step() {  # name cap command...: run with its cap, log to $d/name.log, report the exit status
  local name=$1 limit; limit=$(cap "$2"); shift 2
  timeout -k 10 "$limit" "$@" > "$d/$name.log" 2>&1
  since "$name (exit $?, cap ${limit}s): $(tail -n 1 "$d/$name.log" | cut -c1-150)"
  save
}
bench() {  # label cap fast_path_bench arguments...
  local label=$1 limit=$2; shift 2
  run_step "bench-$label" "$limit" python3 benchmarks/h200/fast_path_bench.py --out "$d" "$@"
  grep -h '^{' "$d/bench-$label.log" > "$d/bench-$label.jsonl"; python3 benchmarks/h200/summarize.py "$d/bench-$label.jsonl"
}
attention() {  # label cap attention-benchmark arguments...: the TRITON_ATTN kernel alone on decode shapes
  local label=$1 limit=$2; shift 2
  run_step "attn-$label" "$limit" python3 -m kvllm.benchmarks.attention --backends TRITON_ATTN --peers triton \
    --shape decode256:256x1@1024 --only-shapes --output-json "$d/attn-$label.json" "$@"
  grep -E "TRITON_ATTN " "$d/attn-$label.log" | grep -v skipped | head -n 4
}
parallel_tests() {  # cap "name|pytest args" ...: GPU test files side by side, one log each (saved as each ends;
  # -k 10: the 2026-12-01 call's tests outlived their TERM and the call, and their logs were lost)
  local limit; limit=$(cap "$1"); shift
  # Waits on the test processes by pid: a bare `wait` also waits for the clock sampler below, which never
  # ends (the eighth session's call hung there until it was killed, and the test logs were lost).
  # faulthandler_timeout: a test running past 60 s prints every thread's stack into its log.
  local spec pids=()
  for spec in "$@"; do
    local name=${spec%%|*} args=${spec#*|}
    (KVLLM_GPU_REPORT_DIR=$d timeout -k 10 "$limit" bash -c \
      "python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -o faulthandler_timeout=60 $args" \
      > "$d/tests-$name.log" 2>&1; save) &
    pids+=($!)
  done
  wait "${pids[@]}"
  for spec in "$@"; do since "tests ${spec%%|*}: $(tail -n 1 "$d/tests-${spec%%|*}.log")"; done
  grep -hE "^(FAILED|ERROR)" "$d"/tests-*.log | head -n 20
  save
}
stage_structured_outputs() {  # xgrammar into /tmp/so-site and the Qwen3 tokenizer into /tmp/so-tok, from
  # .so-bench or .so-lite (the same, the tokenizer gzipped to fit beside vLLM's part 2); 1 when neither came
  local tok=/tmp/so-tok
  mkdir -p /tmp/so-site "$tok"
  if [ -d .so-bench/wheels ]; then
    for w in .so-bench/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/so-site; done
    cp .so-bench/qwen3-tokenizer/* "$tok"/
  elif [ -d .so-lite ]; then
    for w in .so-lite/*.whl; do python3 -m zipfile -e "$w" /tmp/so-site; done
    gunzip -c .so-lite/tokenizer.json.gz > "$tok/tokenizer.json"; cp .so-lite/tokenizer_config.json "$tok"/
  else
    return 1
  fi
}
structured_outputs() {  # issue 19: the batch-64 bench and the GPU tests
  local tok=/tmp/so-tok
  stage_structured_outputs || { since "structured outputs: skipped (carry .so-bench or .so-lite)"; return; }
  (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=$tok
   run_step so-bench 70 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer "$tok" \
     --out "$d/structured_outputs.json"
   tail -n 1 "$d/so-bench.log"
   run_step so-tests "${SO_TESTS_CAP:-50}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
     tests/gpu/test_structured_outputs_gpu.py)
}
so_runs() {  # count: the batch-64 structured-outputs bench (issue 19) `count` times, three repeats each
  stage_structured_outputs || { since "structured outputs: skipped (carry .so-bench or .so-lite)"; return; }
  (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok
   for i in $(seq 1 "$1"); do
     run_step "so-$i" 45 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer /tmp/so-tok \
       --repeats 3 --out "$d/so-$i.json"
     tail -n 1 "$d/so-$i.log"
   done)
}
gemv_sweep_and_e2e() {  # issue 22 on the H200: the one-row GEMV sweep (--set h200), then AWQ (with the
  # sweep's table, when it wrote one) and bf16 end to end
  run_step gemv-sweep 170 python3 benchmarks/h200/w4a16_gemv_m1.py --out "$d" --set h200 --budget-s 130 \
    --table-out "$d/w4a16_gemv_configs.json"
  sed -n '/best per shape/,$p' "$d/gemv-sweep.log" | head -12
  local table=()
  [ -f "$d/w4a16_gemv_configs.json" ] && table=(env "KVLLM_W4A16_GEMV_CONFIGS=$d/w4a16_gemv_configs.json")
  run_step e2e-table 150 "${table[@]}" python3 benchmarks/h200/quant_bench.py --out "$d/e2e-table" --parts e2e \
    --engines awq,bf16 --quick
  grep -h '^e2e ' "$d/e2e-table.log" | cut -c1-220
}
decode_rows() {  # timings...: issue 23's two decode rows the thirtieth session's H200 table missed (TRITON_ATTN
  # b1 x 32k beside SDPA, FLEX_ATTENTION b256 x 1k), once per --timing given, in that order
  local i=0 timing
  for timing in "$@"; do
    i=$((i + 1))
    run_step "rows-$i-$timing" 60 python3 -m kvllm.benchmarks.attention --backends TRITON_ATTN,FLEX_ATTENTION \
      --only-shapes --shape "decode b1 x ctx32k:1x1@32767" --shape "decode b256 x ctx1k:256x1@1023" \
      --peers triton,sdpa,flex --timing "$timing" --output-json "$d/rows-$i-$timing.json"
    grep -E "TRITON_ATTN |FLEX_ATTENTION |SDPA" "$d/rows-$i-$timing.log" | cut -c1-110
  done
}
so_ab() {  # arms...: the batch-64 structured-outputs bench (issue 19), each arm with main's $SO_FILES ("after")
  # or .ab/<name>_<arm>.py for each (e.g. "before"); main's files are put back at the end
  local files=${SO_FILES:-kvllm/sample/gumbel.py kvllm/sample/sampler.py kvllm/worker/model_runner.py} f i=0 arm
  for f in $files; do cp "$f" "/tmp/$(basename "$f" .py)_after.py"; done
  for arm in "$@"; do
    i=$((i + 1))
    for f in $files; do
      if [ "$arm" = after ]; then cp "/tmp/$(basename "$f" .py)_after.py" "$f"; else cp ".ab/$(basename "$f" .py)_$arm.py" "$f"; fi
    done
    run_step "so-$arm-$i" 45 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer /tmp/so-tok \
      --repeats 2 --out "$d/so-$arm-$i.json"
    tail -n 1 "$d/so-$arm-$i.log"
  done
  for f in $files; do cp "/tmp/$(basename "$f" .py)_after.py" "$f"; done
}
issue17_beside_vllm() {  # vLLM's third staged part, then kvllm and vLLM 0.22 on issue 17's table (batch 1-256
  # latency, nano-vllm with kvllm's kernel timeline, 256 x 128/128), one process each
  bash .vllm/part3/remote-stage.sh 3 > "$d/vllm-stage3.log" 2>&1 || { tail -n 5 "$d/vllm-stage3.log"; save; exit 3; }
  tail -n 3 "$d/vllm-stage3.log"
  bench kvllm 140 --engine kvllm --backend TRITON_ATTN --only latency,nano,bs256 --iters 3 --warmups 2 \
    --profile-nano --out "$d/kvllm"
  (export PYTHONPATH=.:/tmp/site-vllm; bench vllm 250 --engine vllm --only latency,nano,bs256 --iters 3 \
    --warmups 2 --out "$d/vllm")
}
issue19_beside_vllm() {  # the batch-64 structured-outputs bench, kvllm then vLLM (staged by an earlier call)
  structured_outputs
  if [ -d /tmp/site-vllm ]; then
    (export PYTHONPATH=.:/tmp/site-vllm:/tmp/so-site
     run_step so-vllm 150 python3 benchmarks/h200/structured_outputs_bench.py --engine vllm --tokenizer /tmp/so-tok \
       --out "$d/structured_outputs_vllm.json"
     tail -n 1 "$d/so-vllm.log")
  fi
}
on_h200() { grep -q H200 "$d/gpu.txt"; }
so_pairs() {  # the grammar process (deferred sampling) against the engine thread, alternating twice
  stage_structured_outputs || { since "no .so-lite"; return; }
  (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok
   run_step so-tests 50 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_structured_outputs_gpu.py
   i=0
   for arm in process thread process thread; do
     i=$((i + 1)); flag=""; [ "$arm" = process ] && flag=--grammar-process
     run_step "so-$arm-$i" 45 python3 benchmarks/h200/structured_outputs_bench.py --tokenizer /tmp/so-tok --repeats 2 \
       $flag --out "$d/so-$arm-$i.json"
     tail -n 1 "$d/so-$arm-$i.log"
   done)
}
h200_first() {  # vLLM's first piece, then main's batch 1-256 latency
  run_step vllm-stage1 40 bash .vllm/part1/remote-stage.sh 1
  bench latency 150 --engine kvllm --backend TRITON_ATTN --only latency --iters 5 --warmups 2 --out "$d/latency"
}

flex_rows() {  # issue 23: FLEX_ATTENTION's rows timed both ways (do_bench's flushed single calls; queued)
  for timing in ${@:-queued bench}; do
    run_step "flex-$timing" 80 python3 -m kvllm.benchmarks.attention --backends FLEX_ATTENTION --peers flex,sdpa \
      --only-shapes --shape "decode b256 x ctx1k:256x1@1023" --shape "prefill 8x2048 causal:8x2048@0" \
      --timing "$timing" --output-json "$d/flex-$timing.json"
    grep -E "FLEX_ATTENTION|flex|sdpa" "$d/flex-$timing.log" | grep -v skipped | head -n 6 | cut -c1-220
    python3 -c "import json,sys; [print(r['shape'], 'build', r['build_ms'], 'at a 0.1 ms switch interval',
      r['extra'].get('build_ms_switch_100us'), r['extra'].get('python_threads')) for r in json.load(open(sys.argv[1]))['rows']
      if r['kernel'] == 'FLEX_ATTENTION' and r.get('build_ms')]" "$d/flex-$timing.json"
  done
}

gemv_pdl_ab() {  # issue 22: AWQ's batch-1 e2e with the decode GEMV under PDL and without, ABBA, bf16 once
  for order in awq,awq-pdl,bf16 awq-pdl,awq; do
    run_step "e2e-$order" 200 python3 benchmarks/h200/quant_bench.py --out "$d/e2e-$order" --parts e2e \
      --engines "$order" --quick
    grep -h '^e2e ' "$d/e2e-$order.log"
  done
}
end_phase() {  # a phase's last step: stop the clock sampler and the host probe, save the tarball
  kill "$clocks_pid" "${host_probe_pid:-}" 2>/dev/null
  save
  since "done"
}
sampling_files_aab() {  # issue 19: main's sampling files copied in two ways, then 89834d4~1's (session19.sh e)
  if stage_structured_outputs; then
    (export PYTHONPATH=.:/tmp/so-site KVLLM_QWEN3_TOKENIZER=/tmp/so-tok SO_FILES="kvllm/sample/gumbel.py kvllm/sample/sampler.py"
     so_ab ${SO_ARMS:-after same same after before before})
  fi
}
nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.max.sm --format=csv,noheader | tee "$d/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$d/gpu.txt"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu --format=csv -lms 250 \
  > "$d/clocks.csv" 2>/dev/null &
clocks_pid=$!
# The host CPU's speed over the call (a fresh machine's host ran Python at about half speed for its first
# ~2 minutes in the ninth session): host_probe.py's loop timed every 5 s, into host_probe.csv.
python3 benchmarks/h200/host_probe.py --csv "$d/host_probe.csv" &
host_probe_pid=$!

