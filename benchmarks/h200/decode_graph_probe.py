"""Is a decode step bound by the GPU or by the host? The engine's own decode graph replayed alone.

    PYTHONPATH=. python3 benchmarks/h200/decode_graph_probe.py --out DIR [--backend TRITON_ATTN]

Per batch size (1, 8, 64, 256): a latency run as fast_path_bench.py's (32 in / 128 out, temperature 1.0),
then the engine's captured decode graph of that size replayed back to back, timed with CUDA events and on
the host's clock (`replay_host_us`: the launch's own cost to the engine's thread; its buffers hold the
run's last step, so attention reads ~160 tokens of context), and the step's largest work
outside the graph timed the same way: an lm_head GEMM of the model's shape (random rows and weight). When
the graph plus lm_head is close to the run's ms per output token the step is GPU-bound, and kernels are
what to cut; when it is well below, the host is the wall. For the `--profile` batch sizes the replays also
run under torch.profiler, summarized by kernel_timeline.py (exclusive time by kernel and kind). One JSON
line per batch size to DIR/decode_graph_probe.jsonl and stdout. (The sixteenth session's raw files have
`kernel_us_per_replay` instead: each kernel's own span, which overlaps the next one's under PDL.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.h200.fast_path_bench import VOCAB, KvllmEngine, timed  # noqa: E402
from kvllm.benchmarks.datasets import random_requests  # noqa: E402
from kvllm.benchmarks.model_shapes import write_shape_only_model  # noqa: E402


def replay_ms(replay, replays: int = 200) -> tuple[float, float]:
    """(device ms per replay back to back, host us per replay call: the launch the engine's thread pays,
    with the GIL released, while the device is still busy with earlier replays)."""
    import torch

    for _ in range(10):
        replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host_started = time.perf_counter()
    for _ in range(replays):
        replay()
    host_s = time.perf_counter() - host_started
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays, host_s / replays * 1e6


def kernels_over_replays(replay, replays: int = 20) -> dict:
    """`replays` replays under torch.profiler, summarized by kernel_timeline (each kernel charged only the
    time it extends the timeline: under PDL a kernel's own span includes its wait for the one before)."""
    from benchmarks.h200.kernel_timeline import profile_kernels

    replay()
    return {"replays": replays, **profile_kernels(lambda: [replay() for _ in range(replays)])[1]}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="TRITON_ATTN")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--profile", default="1", help="batch sizes whose replays run under torch.profiler")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    from benchmarks.h200.graph_timing import graph_call_ms

    model = str(write_shape_only_model("Qwen3-0.6B", "/tmp/qwen3-0.6b-shape"))
    engine = KvllmEngine(model, args.backend, False, True, "auto")
    runner = engine.llm.llm_engine.executor.worker.model_runner
    graphs = runner.decode_graphs.single.graphs
    hidden_size = next(iter(graphs.values())).hidden.shape[-1]
    lm_head = torch.randn(VOCAB, hidden_size, device="cuda", dtype=torch.bfloat16) * 0.02
    profiled = {int(b) for b in args.profile.split(",") if b}
    sink = open(out / "decode_graph_probe.jsonl", "w")
    seed = iter(range(5000, 100000))
    for bs in (int(b) for b in args.batches.split(",")):
        for _ in range(2):
            engine.generate(random_requests(bs, 32, 128, VOCAB, seed=next(seed)), 1.0)
        runs = [timed(engine, random_requests(bs, 32, 128, VOCAB, seed=next(seed)), 1.0)[0] for _ in range(3)]
        step_ms = sum(runs) / len(runs) / 128 * 1e3
        entry = graphs.get(bs)
        graph_ms, launch_us = replay_ms(entry.graph.replay) if entry is not None else (None, None)
        x = torch.randn(bs, hidden_size, device="cuda", dtype=torch.bfloat16)
        lm_head_ms = graph_call_ms(
            lambda i, x=x: torch.nn.functional.linear(x, lm_head), calls=20, replays=20
        )
        gpu_ms = graph_ms + lm_head_ms if graph_ms is not None else None
        kernels = kernels_over_replays(entry.graph.replay) if entry is not None and bs in profiled else {}
        record = {
            "bench": "decode_graph_probe",
            "batch_size": bs,
            "ms_per_output_token": round(step_ms, 4),
            "graph_replay_ms": None if graph_ms is None else round(graph_ms, 4),
            "replay_host_us": None if launch_us is None else round(launch_us, 1),
            "lm_head_ms": round(lm_head_ms, 4),
            "graph_plus_lm_head_ms": None if gpu_ms is None else round(gpu_ms, 4),
            "gpu_share_of_step": None if gpu_ms is None else round(gpu_ms / step_ms, 3),
            "kernels": kernels,
            "unix": time.time(),
            "gpu": torch.cuda.get_device_name(),
        }
        line = json.dumps(record)
        print(line, flush=True)
        sink.write(line + "\n")
        sink.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
