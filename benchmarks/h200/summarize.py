"""Print a short table of fast_path_bench results, and optionally plot them side by side:

python3 benchmarks/h200/summarize.py FILE.jsonl ... [--plot OUT.png]
"""

from __future__ import annotations

import json
import sys


def describe(r: dict) -> str:
    kind = r["bench"]
    if kind == "startup":
        return f"{r['seconds']:.1f} s"
    if kind in ("latency", "latency_late"):
        ctx = f" in{r['input_len']}" if r.get("input_len", 32) != 32 else ""
        runs = ", ".join(f"{s * 1e3:.1f}" for s in r["latencies_s"])
        late = " (after the heavy runs)" if kind == "latency_late" else ""
        clocks = f", SM MHz {r['sm_clock_mhz_after']}" if any(r.get("sm_clock_mhz_after") or []) else ""
        return f"bs{r['batch_size']}{ctx}{late}: {r['ms_per_output_token']:.3f} ms per output token (runs {runs} ms{clocks})"
    if kind == "ttft":
        return f"1k-token prompt: {r['mean_ms']:.1f} ms"
    if kind == "step_profile":
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r["host_ms_per_step_by_phase"].items() if k != "step")
        top = ", ".join(
            f"{k[:40]} {v:.0f}us" for k, v in list(r.get("gpu_us_by_kernel_per_step", {}).items())[:3]
        )
        return (
            f"bs{r['batch_size']} ctx{r['input_len']}: {r['wall_ms_per_step']:.3f} ms/step, GPU busy {r['gpu_busy_ms_per_step']:.3f} ms, "
            f"{r['cuda_kernels_per_layer']:.1f} kernels/layer; host ms: {phases}; top GPU: {top}"
        )
    if kind == "step_log":
        kinds = ", ".join(f"{k} {v['steps']} steps {v['ms'] / 1e3:.2f} s" for k, v in r["by_kind"].items())
        by_batch = ", ".join(f"{k} {v:.2f}" for k, v in r["decode_ms_per_step_by_batch"].items())
        return (
            f"{r['run']}: {kinds}; decode ms/step by batch {by_batch}; "
            f"{r['triton_compiles']} Triton compiles ({r['triton_compile_ms'] / 1e3:.2f} s)"
        )
    if kind == "latency_steps":
        return (
            f"bs1 run {r['wall_ms']:.1f} ms = {r['steps']} steps {r['steps_ms']:.1f} ms; first steps "
            f"{r['first_steps_ms']} ms ({r['first_steps_tokens']} tokens), median {r['median_step_ms']:.3f}"
        )
    if kind == "nano_kernels":
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in r["exclusive_ms_by_kind"].items())
        idle = ", ".join(f"{k} {v:.0f}" for k, v in r["idle_ms_by_gap"].items())
        return (
            f"nano under the profiler: wall {r['wall_ms']:.0f} ms, kernels busy {r['busy_ms']:.0f} ms "
            f"({r['busy_fraction_of_wall']:.3f}); ms by kind: {kinds}; idle ms by gap: {idle}"
        )
    if "out_tok_per_s" not in r:
        return json.dumps({k: v for k, v in r.items() if k not in ("engine", "bench")})[:200]
    busy = r.get("gpu_busy")
    return f"{r['out_tok_per_s']:.0f} output tok/s ({r['seconds']:.2f} s), GPU busy {busy if busy is None else round(busy, 3)}"


def load(paths: list[str]) -> list[dict]:
    records = []
    for path in paths:
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


def plot(records: list[dict], out: str) -> None:
    """Per engine: ms per output token by batch size, and output tok/s of the two throughput runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = list(dict.fromkeys(r["engine"] for r in records))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for engine in engines:
        rows = sorted(
            (r["batch_size"], r["ms_per_output_token"])
            for r in records
            if r["engine"] == engine and r["bench"] == "latency" and r.get("input_len", 32) == 32
        )
        left.plot([b for b, _ in rows], [v for _, v in rows], marker="o", label=engine)
    left.set(
        xscale="log", xlabel="batch size (32 in / 128 out)", ylabel="ms per output token", title="Latency"
    )
    left.legend()
    width = 0.8 / max(1, len(engines))
    for i, engine in enumerate(engines):
        values = [
            next((r["out_tok_per_s"] for r in records if r["engine"] == engine and r["bench"] == b), 0)
            for b in ("nano", "bs256")
        ]
        right.bar([x + i * width for x in range(2)], values, width, label=engine)
    right.set_xticks(
        [x + width * (len(engines) - 1) / 2 for x in range(2)], ["nano-vllm workload", "256 x 128/128"]
    )
    right.set(ylabel="output tokens/s", title="Throughput")
    right.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    args = sys.argv[1:]
    out = None
    if "--plot" in args:
        i = args.index("--plot")
        out = args[i + 1]
        args = args[:i] + args[i + 2 :]
    records = load(args)
    for r in records:
        print(f"   {r['engine']:<26} {r['bench']:<8} {describe(r)}")
    if out:
        plot(records, out)


if __name__ == "__main__":
    main()
