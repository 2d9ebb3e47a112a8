"""Where FLEX_ATTENTION's builder spends its host time on a GPU (issue 23): build() timed with and without a
device sync after it, then under torch.profiler (CPU ops by self time, and the CUDA kernels it queues).

    PYTHONPATH=. python3 benchmarks/h200/flex_build_probe.py [--out DIR]

The fourteenth session's attention bench measured build() at 8.0 ms (decode 256 x 1k) and 24.0 ms (prefill
8 x 2048) on an H100 against 0.05-0.24 ms on the CPU; this says which op holds it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvllm.attention.reference import make_paged_batch
from kvllm.attention.registry import get_backend_class
from kvllm.attention.testing import make_builder

SHAPES = {"decode256x1k": ([1] * 256, [1023] * 256), "prefill8x2048": ([2048] * 8, [0] * 8)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    backend = get_backend_class("FLEX_ATTENTION")
    for name, (qlens, ctxs) in SHAPES.items():
        batch = make_paged_batch(qlens, ctxs, 16, 8, 128, 16, dtype=torch.bfloat16, device="cuda", seed=0)
        builder = make_builder(backend, batch, torch.bfloat16, "auto")
        md = batch.metadata
        devices = {k: str(getattr(md, k).device) for k in ("block_table", "seq_lens", "slot_mapping")}
        for _ in range(3):
            builder.build(md)
        torch.cuda.synchronize()
        for synced in (False, True):
            samples = []
            for _ in range(20):
                start = time.perf_counter()
                builder.build(md)
                if synced:
                    torch.cuda.synchronize()
                samples.append((time.perf_counter() - start) * 1e3)
            torch.cuda.synchronize()
            samples.sort()
            print(f"{name} build {'+ sync' if synced else 'alone '}: median {samples[10]:.3f} ms, min "
                  f"{samples[0]:.3f} ms; metadata on {devices}", flush=True)  # fmt: skip
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                builder.build(md)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        (out / f"flex_build_{name}.txt").write_text(table)
        print(table, flush=True)


if __name__ == "__main__":
    main()
