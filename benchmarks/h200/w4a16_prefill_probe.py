"""Where a short W4A16 prefill's time goes, and what could take it (issue 22).

    PYTHONPATH=. python3 benchmarks/h200/w4a16_prefill_probe.py --out DIR [--rows 32,64] [--budget-s 150]
        [--gemm-block-m 64|128] [--dequant-default-only]

From DEQUANT_MIN_ROWS rows a W4A16 linear dequantizes its weight to bf16 (one Triton launch), then
cuBLAS multiplies. When that was from 17 rows, the batch-1 e2e run's 32-token prefill spent 18 ms (H100)
dequantizing for its 128 linears (141 us a call, about 1 TB/s): 0.14 ms a token over its 128 output tokens.
Here, on Llama-3-8B's four projections (group 128, cold weight copies, CUDA-graph timing as
quant_bench.py's kernels):
  - the dequantize launch alone for each (block_n, values per row, warps) candidate, its output checked
    equal to the default's bit for bit, in TB/s of bytes read and written;
  - at each M of --rows: bf16 F.linear, dequantize (default, then the best candidate) + cuBLAS, and the
    Triton tensor-core GEMM for each (block_m, block_n, block_k, split_k, warps, stages) candidate, each
    checked against F.linear on the dequantized weight.
One JSON line per timing in DIR/w4a16_prefill_probe.jsonl, then a table: per shape and M the best of
each route.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.h200.quant_bench import GROUP, SHAPES, copies, graph_us  # noqa: E402

# (block_n, values per row, warps); the first is dequantize_triton's default
DEQUANT_CANDIDATES = [(8, 512, 4)] + [
    (bn, v, w)
    for bn in (8, 16, 32, 64)
    for v in (256, 512, 1024)
    for w in (4, 8)
    if (bn, v, w) != (8, 512, 4)
]
# (block_m, block_n, block_k, split_k, warps, stages) of _w4a16_kernel
GEMM_CANDIDATES = [
    (bm, bn, 128, s, 4, 3) for bm in (16, 32, 64) for bn in (32, 64, 128) for s in (1, 2, 4, 8)
]


def gemm_candidates(block_m: int | None) -> list[tuple[int, ...]]:
    """GEMM_CANDIDATES, or those with `block_m` rows a tile (128: the large-M tiles, not in the list)."""
    if block_m == 128:
        return [(128, 128, 128, s, 8, 3) for s in (1, 2, 4)] + [(128, 64, 128, 1, 4, 3)]
    return [c for c in GEMM_CANDIDATES if block_m is None or c[0] == block_m]


def probe_shape(
    shape: str,
    n: int,
    k: int,
    rows: list[int],
    deadline: float,
    emit: Callable[..., None],
    dequant_candidates: list[tuple[int, int, int]] = DEQUANT_CANDIDATES,
    gemm_configs: list[tuple[int, ...]] = GEMM_CANDIDATES,
) -> None:
    """One projection: the dequantize candidates (the first is the default), then each route at each row
    count."""
    import torch
    import torch.nn.functional as F

    from kvllm.layers.quantization.ops.int4_layout import pack_kernel_layout
    from kvllm.layers.quantization.ops.w4a16 import W4A16Config, dequantize_triton, w4a16_triton

    dev = torch.device("cuda")

    def make_w4() -> tuple:
        q = pack_kernel_layout(torch.randint(0, 16, (n, k), device=dev))
        s = (torch.rand(n, k // GROUP, device=dev) * 0.003 + 0.001).bfloat16()
        z = torch.randint(0, 16, (n, k // GROUP), device=dev).bfloat16()
        return q, s, z

    w4_bytes = n * k // 2 + 2 * 2 * n * (k // GROUP)
    w4 = copies(make_w4, w4_bytes + n * k * 2)
    reference = dequantize_triton(*w4[0], GROUP, torch.bfloat16)

    def dequant(i: int, cfg: tuple[int, int, int] = dequant_candidates[0]) -> torch.Tensor:
        return dequantize_triton(*w4[i % len(w4)], GROUP, torch.bfloat16, *cfg)

    dequant_us: dict[tuple[int, int, int], float] = {}
    for cfg in dequant_candidates:
        if time.monotonic() > deadline:
            break
        rec: dict[str, Any] = {"shape": shape, "impl": "dequantize", "config": cfg}
        try:
            same = torch.equal(dequant(0, cfg), reference)
            us = graph_us(lambda i, cfg=cfg: dequant(i, cfg))
            rec |= {"us": round(us, 2), "tbps": round((w4_bytes + n * k * 2) / us / 1e6, 3), "equal": same}
            if same:
                dequant_us[cfg] = us
        except Exception as e:  # a config that does not compile here: recorded, not fatal
            rec["error"] = repr(e)[:300]
        emit(rec, (shape, 0, "dequantize") if rec.get("equal") else None)
    fastest = min(dequant_us, key=dequant_us.__getitem__) if dequant_us else dequant_candidates[0]
    bf16 = copies(lambda: (torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02,), n * k * 2)
    for m in rows:
        if time.monotonic() > deadline:
            break
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        expected = F.linear(x.float(), reference.float())
        routes = {
            "bf16 F.linear": lambda i, x=x: F.linear(x, bf16[i % len(bf16)][0]),
            "dequant+cuBLAS": lambda i, x=x: F.linear(x, dequant(i)),
            "best dequant+cuBLAS": lambda i, x=x: F.linear(x, dequant(i, fastest)),
        }
        for impl, fn in routes.items():
            us = graph_us(fn)
            emit(
                {"shape": shape, "m": m, "impl": impl, "us": round(us, 2), "config": fastest},
                (shape, m, impl),
            )
        for cfg in gemm_configs:
            if time.monotonic() > deadline:
                break
            if cfg[0] > 16 and cfg[0] > m:
                continue
            c = W4A16Config(*cfg)
            rec = {"shape": shape, "m": m, "impl": "gemm", "config": cfg}
            try:
                got = w4a16_triton(x, *w4[0], GROUP, config=c).float()
                err = ((got - expected).norm() / expected.norm()).item()
                us = graph_us(lambda i, c=c, x=x: w4a16_triton(x, *w4[i % len(w4)], GROUP, config=c))
                rec |= {"us": round(us, 2), "tbps": round(w4_bytes / us / 1e6, 3), "rel_err": round(err, 5)}
            except Exception as e:
                rec["error"] = repr(e)[:300]
            emit(rec, (shape, m, "gemm") if rec.get("rel_err", 1.0) < 1e-2 else None)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="32,64")
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument(
        "--gemm-block-m", type=int, help="only the GEMM candidates with this many rows a tile"
    )
    parser.add_argument("--dequant-default-only", action="store_true", help="skip the dequantize candidates")
    args = parser.parse_args()
    dequant_candidates = DEQUANT_CANDIDATES[:1] if args.dequant_default_only else DEQUANT_CANDIDATES
    gemm_configs = gemm_candidates(args.gemm_block_m)
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    log = (args.out / "w4a16_prefill_probe.jsonl").open("w")
    best: dict[tuple[str, int, str], tuple[float, Any]] = {}

    def emit(rec: dict[str, Any], key: tuple[str, int, str] | None = None) -> None:
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if key is not None and "us" in rec and (key not in best or rec["us"] < best[key][0]):
            best[key] = (rec["us"], rec.get("config"))

    for shape, (n, k) in SHAPES.items():
        if time.monotonic() > deadline:
            print(f"budget spent before {shape}", flush=True)
            break
        rows = [int(r) for r in args.rows.split(",")]
        probe_shape(shape, n, k, rows, deadline, emit, dequant_candidates, gemm_configs)
        torch.cuda.empty_cache()
    log.close()
    print(f"{'shape':8} {'M':>3} {'route':22} {'us':>8}  config")
    for (shape, m, impl), (us, cfg) in sorted(best.items()):
        print(f"{shape:8} {m or '-':>3} {impl:22} {us:8.2f}  {cfg}")  # M - : the dequantize launch alone


if __name__ == "__main__":
    main()
