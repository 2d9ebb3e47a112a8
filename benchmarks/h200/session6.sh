#!/usr/bin/env bash
# The sixth session's H200 calls, one phase per call (raw results under $OUT/<phase>/, written as they
# come so a call cut short still returns what it did, plus a short table on stdout):
#   early   PDL (kvllm/utils/pdl.py): GPU tests, batch-1..256 latency and nano-vllm with it on, latency
#           with it off (KVLLM_PDL=0); speculative decoding's batch-1 bench; the model-family GPU tests.
#   where   where a batch-1 latency run's time goes (per-step log; cProfile of an eager prefill request
#           and of graph decodes), then the model-family GPU tests in full (logs tarred: the device
#           tool returns at most about eight files).
#   pw      piecewise graphs (kvllm/worker/piecewise_graph.py): graphs-vs-eager test, batch-1..256
#           latency with the step log, TTFT of a 1k prompt.
#   helpers carry [".gpu-branches"] (git-archive snapshots of the helpers' branches, one folder each):
#           each helper's GPU command from its own folder, under a time cap, results as $OUT/<name>.tgz.
#   final   carry [".vllm/part1"]: vLLM's part 1 onto the machine, then kvllm's fast path (latency,
#           TTFT, nano-vllm, 256 x 128/128; nano-vllm with an fp8 KV cache) and speculative decoding.
#   final-vllm  carry [".vllm/part2"], sent within 30 s of `final`: vLLM 0.22 through the same bench.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
started=$(date +%s)
since() { echo "[$(( $(date +%s) - started )) s] $*"; }

bench() {  # $1 label, $2 timeout, rest: fast_path_bench arguments
  local label=$1 limit=$2; shift 2
  timeout "$limit" python3 benchmarks/h200/fast_path_bench.py --out "$d" "$@" > "$d/bench-$label.log" 2>&1
  since "bench $label (exit $?)"
  grep -h '^{' "$d/bench-$label.log" > "$d/bench-$label.jsonl"; python3 benchmarks/h200/summarize.py "$d/bench-$label.jsonl"
}

gpu_info() {
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader | tee "$d/gpu.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$d/gpu.txt"
}

case "${1:?usage: session6.sh early|where|pw|helpers|final|final-vllm}" in
early)
  d=$out/early; mkdir -p "$d"; gpu_info
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_pdl_gpu.py \
    tests/gpu/test_cuda_graphs_gpu.py -k "not FLASH" > "$d/pytest-pdl.log" 2>&1
  since "PDL + graph tests: $(tail -n 1 "$d/pytest-pdl.log")"
  bench pdl 180 --engine kvllm --backend TRITON_ATTN --only latency,nano --iters 2 --warmups 1 --profile-batches 1,256
  KVLLM_PDL=0 bench no-pdl 90 --engine kvllm --backend TRITON_ATTN --only latency --iters 2 --warmups 1
  timeout 120 python3 benchmarks/h200/spec_decode_bench.py --out "$d" > "$d/spec-decode.log" 2>&1
  since "spec decode bench (exit $?)"; tail -n 8 "$d/spec-decode.log"
  timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_models_gpu.py \
    tests/gpu/test_spec_decode_gpu.py > "$d/pytest-models.log" 2>&1
  since "model + spec GPU tests: $(tail -n 1 "$d/pytest-models.log")"
  since "done"
  ;;
where)
  d=/tmp/where; mkdir -p "$d"; gpu_info
  bench steps 150 --engine kvllm --backend TRITON_ATTN --only latency --iters 2 --warmups 1 --step-log
  grep latency_steps "$d/bench-steps.log"
  timeout 150 python3 benchmarks/h200/host_profile.py --out "$d" --batches 1 --prefill > "$d/host.log" 2>&1
  since "host profile (exit $?)"; grep "ms/" "$d/host.log"; head -n 45 "$d/host-prefill.txt" | tail -n 36
  KVLLM_GPU_REPORT_DIR=$d timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/gpu/test_models_gpu.py > "$d/pytest-models.log" 2>&1
  since "model GPU tests: $(tail -n 1 "$d/pytest-models.log")"; grep -E "^(FAILED|ERROR)" "$d/pytest-models.log" | head -20
  tar czf "$out/where.tgz" -C /tmp where
  since "done"
  ;;
pw)
  d=/tmp/pw; mkdir -p "$d"; gpu_info
  KVLLM_GPU_REPORT_DIR=$d timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/gpu/test_cuda_graphs_gpu.py -k TRITON > "$d/pytest-graphs.log" 2>&1
  since "graphs vs eager: $(tail -n 1 "$d/pytest-graphs.log")"; grep -E "^(E |FAILED)" "$d/pytest-graphs.log" | head -8
  bench pw 150 --engine kvllm --backend TRITON_ATTN --only latency,ttft --iters 2 --warmups 1 --step-log
  grep -h latency_steps "$d/bench-pw.log"; grep -i "piecewise" "$d/bench-pw.log" | head -3
  tar czf "$out/pw.tgz" -C /tmp pw
  since "done"
  ;;
helpers)
  run_helper() {  # name cap command: run the command in .gpu-branches/<name> with OUT=/tmp/helpers/<name>
    local name=$1 cap=$2; shift 2
    [ -d ".gpu-branches/$name" ] || { echo "no snapshot of $name"; return; }
    mkdir -p "/tmp/helpers/$name"
    (cd ".gpu-branches/$name" && OUT=/tmp/helpers/$name PYTHONPATH=. timeout "$cap" bash -c "$*" \
      > "/tmp/helpers/$name/stdout.log" 2>&1)
    since "$name (exit $?)"; tail -n 30 "/tmp/helpers/$name/stdout.log"
    tar czf "$out/$name.tgz" -C /tmp/helpers "$name"
  }
  run_helper w4a16 205 "$(cat .gpu-branches/w4a16.cmd)"
  run_helper prefill 105 "$(cat .gpu-branches/prefill.cmd)"
  run_helper mla 175 "$(cat .gpu-branches/mla.cmd)"
  since "done"
  ;;
final)
  d=/tmp/final; mkdir -p "$d"
  bash .vllm/part1/remote-stage.sh 1 > "$d/vllm-stage1.log" 2>&1; since "vLLM part 1 staged (exit $?)"
  gpu_info
  bench kvllm 150 --engine kvllm --backend TRITON_ATTN --only latency,ttft,nano,bs256 --iters 3 --warmups 1 --step-log
  bench kvllm-fp8 70 --engine kvllm --backend TRITON_ATTN --only nano --kv-cache-dtype fp8
  timeout 80 python3 benchmarks/h200/spec_decode_bench.py --out "$d" > "$d/spec-decode.log" 2>&1
  since "spec decode bench (exit $?)"; tail -n 9 "$d/spec-decode.log"
  timeout 55 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_fused_moe_gpu.py \
    tests/gpu/test_quant_gpu.py -k "fused_moe or moe or quantized_model" > "$d/pytest-moe-quant.log" 2>&1
  since "MoE + quantized-model GPU tests: $(tail -n 1 "$d/pytest-moe-quant.log")"
  grep -E "^(FAILED|ERROR)" "$d/pytest-moe-quant.log" | head -8
  tar czf "$out/final.tgz" -C /tmp final
  timeout 58 python3 benchmarks/h200/prefill_sweep.py --quick --out-dir "$d" --budget-s 50 --compile-timeout-s 40 \
    --rep-ms 25 > "$d/prefill-sweep.log" 2>&1
  since "prefill sweep (exit $?)"; tail -n 16 "$d/prefill-sweep.log"
  tar czf "$out/final.tgz" -C /tmp final
  since "done"
  ;;
final-vllm)
  d=/tmp/final-vllm; mkdir -p "$d"
  bash .vllm/part2/remote-stage.sh 2 > "$d/vllm-stage2.log" 2>&1 || { tail -n 5 "$d/vllm-stage2.log"; exit 3; }
  tail -n 4 "$d/vllm-stage2.log"
  (export PYTHONPATH=.:/tmp/site-vllm; bench vllm 250 --engine vllm --only latency,nano,bs256 --iters 3 --warmups 2)
  tar czf "$out/final-vllm.tgz" -C /tmp final-vllm
  since "done"
  ;;
esac
