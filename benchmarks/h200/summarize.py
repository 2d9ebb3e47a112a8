"""Print a short table of fast_path_bench results: python3 benchmarks/h200/summarize.py FILE.jsonl ..."""

from __future__ import annotations

import json
import sys


def describe(r: dict) -> str:
    kind = r["bench"]
    if kind == "startup":
        return f"{r['seconds']:.1f} s"
    if kind == "latency":
        return f"bs{r['batch_size']}: {r['ms_per_output_token']:.3f} ms per output token"
    if kind == "ttft":
        return f"1k-token prompt: {r['mean_ms']:.1f} ms"
    if kind == "step_profile":
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r["host_ms_per_step_by_phase"].items() if k != "step")
        return (
            f"bs{r['batch_size']}: {r['wall_ms_per_step']:.3f} ms/step, GPU busy {r['gpu_busy_ms_per_step']:.3f} ms, "
            f"{r['cuda_kernels_per_layer']:.1f} kernels/layer; host ms: {phases}"
        )
    busy = r.get("gpu_busy")
    return f"{r['out_tok_per_s']:.0f} output tok/s ({r['seconds']:.2f} s), GPU busy {busy if busy is None else round(busy, 3)}"


def main() -> None:
    for path in sys.argv[1:]:
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    print(f"   {r['engine']:<26} {r['bench']:<8} {describe(r)}")


if __name__ == "__main__":
    main()
