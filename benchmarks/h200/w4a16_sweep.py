"""The W4A16 launch-config sweep behind `quant_bench.py --sweep` (timing: quant_bench.graph_us).

GEMV (kvllm/layers/quantization/ops/w4a16_gemv.py) at M = 1, 2, 4 and the GEMM paths (the Triton
tensor-core kernel's tiles, and dequantize-then-cuBLAS) at M = 16 .. 256, on Llama-3-8B and Qwen3-0.6B
projections, each beside bf16 (kvllm's GEMV at M <= 4, F.linear / cuBLAS). Every config is tried on its
own: one that fails to compile or run is recorded with its error and the sweep goes on. It stops
starting new configs at its time budget. Weights: group 128, random values, cold copies (more than
the L2 together) cycled through in the graph as consecutive layers would be.

Writes DIR/w4a16_sweep.jsonl (one line per timing) and prints, per shape and M, the best config and
its speed against bf16, then a summary (the fastest config overall per M, by the geometric mean over
shapes of time / best time) to paste into the config tables.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from benchmarks.h200.quant_bench import GROUP, copies, graph_us

SHAPES = {
    "llama8b.qkv": (6144, 4096), "llama8b.o": (4096, 4096), "llama8b.gate_up": (28672, 4096),
    "llama8b.down": (4096, 14336),
    "qwen06b.qkv": (4096, 1024), "qwen06b.o": (1024, 2048), "qwen06b.gate_up": (6144, 1024),
    "qwen06b.down": (1024, 3072),
}  # fmt: skip
GEMV_ROWS = (1, 2, 4)
GEMM_ROWS = (16, 64, 256)
# (block_n, block_k, warps[, stages]): 4 to 32 words per thread per K tile, and at least 8 blocks of
# 128 values per warp (fewer leave the activations' tile a different register layout than the weight's,
# converted every iteration: 5-9 SASS instructions per value instead of 3-4, by compiling for sm_90).
GEMV_CANDIDATES = [
    (bn, bk, w)
    for bn in (1, 2, 4, 8)
    for bk in (1024, 2048, 4096)
    for w in (1, 2, 4)
    if 4 <= bn * bk // (256 * w) <= 32 and bk >= 1024 * w
]
GEMV_CANDIDATES += [(8, 1024, 1, 2), (16, 1024, 1), (16, 2048, 2)]
GEMV_TOP = 6  # configs from the M = 1 ranking tried at M = 2, 4 and fused with SiLU
# At 4 rows only tiles of at most 4 x 1024 or 2 x 2048 values per warp fit in registers.
GEMV_ROWS4 = [(4, 1024, 1), (2, 2048, 1), (2, 1024, 1), (1, 4096, 1), (2, 4096, 2), (4, 2048, 1)]
GEMV_GUESS = [(8, 4096, 4), (8, 1024, 1), (8, 2048, 2), (4, 2048, 1), (4, 4096, 2), (2, 2048, 1)]
# (block_m, block_n, block_k, split_k, warps, stages) of the tensor-core kernel; split only for M = 16
GEMM_CANDIDATES = {
    16: [(16, 64, 128, s, 4, 4) for s in (1, 2, 4, 8)] + [(16, 32, 128, 4, 4, 4), (16, 128, 128, 2, 4, 3)],
    64: [(64, 64, 128, 1, 4, 4), (64, 128, 128, 1, 4, 3), (32, 64, 128, 1, 4, 4), (64, 64, 256, 1, 4, 3)],
    256: [
        (128, 128, 128, 1, 8, 3),
        (64, 128, 128, 1, 4, 3),
        (128, 64, 128, 1, 4, 4),
        (128, 256, 128, 1, 8, 3),
    ],
}


def _weights(n: int, k: int) -> tuple[list[tuple], list[tuple], int, int]:
    import torch

    from kvllm.layers.quantization.ops.int4_layout import pack_kernel_layout

    dev = torch.device("cuda")

    def make_w4() -> tuple:
        q = pack_kernel_layout(torch.randint(0, 16, (n, k), device=dev))
        s = (torch.rand(n, k // GROUP, device=dev) * 0.003).bfloat16()
        z = torch.randint(0, 16, (n, k // GROUP), device=dev).bfloat16()
        return q, s, z

    bf16_bytes = n * k * 2
    w4_bytes = n * k // 2 + 2 * 2 * n * (k // GROUP)
    bf16 = copies(lambda: (torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02,), bf16_bytes)
    return bf16, copies(make_w4, w4_bytes), bf16_bytes, w4_bytes


def sweep(out: Path, budget_s: float) -> list[dict[str, Any]]:
    """Every candidate at every shape and row count (until `budget_s`); JSON lines and a summary."""
    import torch
    import torch.nn.functional as F

    from kvllm.layers.ops.gemv import gemv, gemv_silu_and_mul
    from kvllm.layers.quantization.ops.w4a16 import (
        W4A16Config,
        default_config,
        dequantize_triton,
        w4a16_triton,
    )
    from kvllm.layers.quantization.ops.w4a16_gemv import W4A16GemvConfig, w4a16_gemv, w4a16_gemv_silu_and_mul

    deadline = time.monotonic() + budget_s
    precompile(min(45.0, budget_s / 2))
    records: list[dict[str, Any]] = []
    log = (out / "w4a16_sweep.jsonl").open("w")

    def emit(shape: str, m: int, n: int, k: int, impl: str, fn, nbytes: int, **extra: Any) -> float | None:
        rec: dict[str, Any] = {"part": "sweep", "shape": shape, "m": m, "n": n, "k": k, "impl": impl, **extra}
        try:
            us = graph_us(fn)
            rec |= {"us": round(us, 2), "tbps": round((nbytes + 2 * m * (k + n)) / us / 1e6, 3)}
        except Exception as e:  # one config that does not compile or run here: recorded, not fatal
            rec["error"] = repr(e)[:300]
            us = None
        records.append(rec)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        print(json.dumps(rec), flush=True)
        return us

    ranking: dict[tuple[int, int, int], list[float]] = defaultdict(list)  # M = 1 time / best, per config
    for shape, (n, k) in SHAPES.items():
        if time.monotonic() > deadline:
            print(f"sweep: time budget of {budget_s:.0f} s spent; stopping before {shape}", flush=True)
            break
        bf16, w4, bf16_bytes, w4_bytes = _weights(n, k)
        for m in GEMV_ROWS + GEMM_ROWS:
            if time.monotonic() > deadline:
                print(
                    f"sweep: time budget of {budget_s:.0f} s spent; stopping before {shape} M={m}", flush=True
                )
                break
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            emit(
                shape,
                m,
                n,
                k,
                "bf16 F.linear",
                lambda i, x=x, w=bf16: F.linear(x, w[i % len(w)][0]),
                bf16_bytes,
            )
            if m > 4:
                for cfg in GEMM_CANDIDATES[min(GEMM_CANDIDATES, key=lambda r: abs(r - m))]:
                    if time.monotonic() > deadline:
                        break
                    c = W4A16Config(*cfg)
                    emit(shape, m, n, k, "w4a16 gemm " + "/".join(map(str, cfg)),
                         lambda i, c=c, x=x, w=w4: w4a16_triton(x, *w[i % len(w)], GROUP, config=c), w4_bytes,
                         config=cfg)  # fmt: skip
                emit(shape, m, n, k, "w4a16 dequant+cuBLAS",
                     lambda i, x=x, w=w4: F.linear(x, dequantize_triton(*w[i % len(w)], GROUP, x.dtype)), w4_bytes)  # fmt: skip
                continue
            emit(shape, m, n, k, "bf16 GEMV", lambda i, x=x, w=bf16: gemv(x, w[i % len(w)][0]), bf16_bytes)
            emit(shape, m, n, k, "w4a16 gemm default",
                 lambda i, x=x, w=w4, c=default_config(m, n, k, GROUP): w4a16_triton(x, *w[i % len(w)], GROUP, config=c),
                 w4_bytes)  # fmt: skip
            gated = shape.endswith("gate_up")
            if gated:
                emit(shape, m, n, k, "bf16 GEMV+silu", lambda i, x=x, w=bf16: gemv_silu_and_mul(x, w[i % len(w)][0]),
                     bf16_bytes)  # fmt: skip
            if m == 1:
                candidates = [c for c in GEMV_CANDIDATES if c[1] <= max(512, 2 * k)]
            elif m == 2:
                candidates = _top(ranking, GEMV_TOP)
            else:  # 4 rows of 8 columns run out of registers (spills)
                candidates = GEMV_ROWS4
            times = {}
            for cfg in candidates:
                if time.monotonic() > deadline:
                    break
                c = W4A16GemvConfig(*cfg)
                us = emit(shape, m, n, k, "w4a16 gemv " + "/".join(map(str, cfg)),
                          lambda i, c=c, x=x, w=w4: w4a16_gemv(x, *w[i % len(w)], GROUP, config=c), w4_bytes,
                          config=cfg)  # fmt: skip
                if us is not None:
                    times[cfg] = us
                if gated and cfg in _top(ranking, GEMV_TOP):
                    gc = W4A16GemvConfig(max(1, cfg[0] // 2), *cfg[1:])
                    emit(shape, m, n, k, "w4a16 gemv+silu " + "/".join(map(str, cfg)),
                         lambda i, c=gc, x=x, w=w4: w4a16_gemv_silu_and_mul(x, *w[i % len(w)], GROUP, config=c),
                         w4_bytes, config=cfg)  # fmt: skip
            if m == 1 and times:
                best = min(times.values())
                for cfg, us in times.items():
                    ranking[cfg].append(us / best)
        bf16 = w4 = []
        torch.cuda.empty_cache()
    log.close()
    print_summary(records, ranking)
    return records


def _compile_job(job: tuple[str, tuple[int, ...], int, int]) -> str:
    """One kernel variant compiled into Triton's disk cache by running it on a small weight with the
    sweep's K (what the specialization depends on), in a worker process."""
    import torch

    from kvllm.layers.quantization.ops.w4a16 import W4A16Config, w4a16_triton
    from kvllm.layers.quantization.ops.w4a16_gemv import W4A16GemvConfig, w4a16_gemv, w4a16_gemv_silu_and_mul

    kind, cfg, m, k = job
    n = 256
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q = torch.zeros(n, k // 8, dtype=torch.int32, device="cuda")
    s = torch.ones(n, k // GROUP, dtype=torch.bfloat16, device="cuda")
    if kind == "gemv":
        w4a16_gemv(x, q, s, s, GROUP, config=W4A16GemvConfig(*cfg))
    elif kind == "gemv+silu":
        w4a16_gemv_silu_and_mul(x, q, s, s, GROUP, config=W4A16GemvConfig(*cfg))
    else:
        w4a16_triton(x, q, s, s, GROUP, config=W4A16Config(*cfg))
    torch.cuda.synchronize()
    return f"{kind} {cfg} m={m} k={k}"


def precompile(budget_s: float) -> None:
    """Compile the sweep's likely kernel variants in parallel worker processes (Triton's disk cache
    then serves the timing loop), for at most `budget_s`; anything not done is compiled when first
    timed. A failure here only costs time."""
    ks = sorted({k for _, k in SHAPES.values()})
    jobs: dict[tuple, tuple[str, tuple[int, ...], int, int]] = {}
    for k in ks:
        for cfg in GEMV_CANDIDATES:
            if cfg[1] <= max(512, 2 * k):
                jobs.setdefault(("gemv", cfg, 1, k % cfg[1] == 0), ("gemv", cfg, 1, k))
        for cfg in GEMV_GUESS:
            jobs.setdefault(("gemv", cfg, 2, k % cfg[1] == 0), ("gemv", cfg, 2, k))
        for cfg in GEMV_ROWS4:
            jobs.setdefault(("gemv", cfg, 4, k % cfg[1] == 0), ("gemv", cfg, 4, k))
            gated = (max(1, cfg[0] // 2), *cfg[1:])
            jobs.setdefault(("gemv+silu", gated, 1, k % cfg[1] == 0), ("gemv+silu", gated, 1, k))
        for m, cfgs in GEMM_CANDIDATES.items():
            for cfg in cfgs:
                jobs.setdefault(("gemm", cfg), ("gemm", cfg, m, k))  # K changes no specialization
    start = time.monotonic()
    workers = max(1, min(12, (os.cpu_count() or 2) - 2))
    try:
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        futures = [pool.submit(_compile_job, job) for job in jobs.values()]
        done, pending = wait(futures, timeout=budget_s)
        failed = [f for f in done if f.exception() is not None]
        pool.shutdown(wait=False, cancel_futures=True)
        print(f"precompile: {len(done) - len(failed)} of {len(futures)} variants compiled by {workers} workers "
              f"in {time.monotonic() - start:.0f} s ({len(failed)} failed, {len(pending)} left)", flush=True)  # fmt: skip
        for f in failed[:3]:
            print(f"precompile: {f.exception()!r}"[:300], flush=True)
    except Exception as e:  # no worker pool here: the timing loop compiles everything itself
        print(f"precompile skipped: {e!r}"[:300], flush=True)


def _top(ranking: dict[tuple[int, int, int], list[float]], count: int) -> list[tuple[int, int, int]]:
    """The configs with the smallest geometric mean of time / best time at M = 1 (over the shapes
    timed so far; the first shape's ranking before any: a fixed guess)."""
    if not ranking:
        return GEMV_GUESS[:count]
    scored = sorted(ranking, key=lambda c: math.exp(sum(map(math.log, ranking[c])) / len(ranking[c])))
    return scored[:count]


def print_summary(records: list[dict[str, Any]], ranking: dict[tuple[int, int, int], list[float]]) -> None:
    by_case: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if "us" in r:
            by_case[(r["shape"], r["m"])].append(r)
    print(
        f"\n{'shape':18} {'M':>4} {'best W4A16':34} {'us':>8} {'TB/s':>6} {'bf16 best':18} {'us':>8} {'speed-up':>8}"
    )
    for (shape, m), rows in by_case.items():
        w4 = [r for r in rows if r["impl"].startswith("w4a16") and "+silu" not in r["impl"]]
        bf = [r for r in rows if r["impl"].startswith("bf16") and "+silu" not in r["impl"]]
        if not w4 or not bf:
            continue
        a, b = min(w4, key=lambda r: r["us"]), min(bf, key=lambda r: r["us"])
        print(f"{shape:18} {m:>4} {a['impl'][:34]:34} {a['us']:>8.1f} {a['tbps']:>6.2f} {b['impl'][:18]:18} "
              f"{b['us']:>8.1f} {b['us'] / max(a['us'], 1e-3):>7.2f}x")  # fmt: skip
    if ranking:
        print("\nGEMV configs at M = 1 (block_n, block_k, warps), geometric mean of time / best over shapes:")
        for cfg in _top(ranking, 8):
            score = math.exp(sum(map(math.log, ranking[cfg])) / len(ranking[cfg]))
            print(f"  {cfg}: {score:.3f} over {len(ranking[cfg])} shapes")
