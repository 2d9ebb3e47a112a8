"""The W4A16 GEMV at batch 1 on Llama-3-8B's projections, beside kvllm's bf16 GEMV: a bounded config sweep.

    PYTHONPATH=. python3 benchmarks/h200/w4a16_gemv_m1.py --out DIR [--budget-s 60] [--table-out FILE]

For qkv (6144 x 4096), o (4096 x 4096), gate_up (28672 x 4096; also fused with SiLU) and down
(4096 x 14336), M = 1, group 128: each (block_n, block_k, warps, stages) candidate is first checked against
x @ dequantize(W)^T in float32 on one weight copy (a failing config is recorded, not timed), then
timed as quant_bench.graph_us does (a CUDA graph of 20 calls over cold weight copies, median per call).
The candidates compile first in a process pool. Writes DIR/w4a16_gemv_m1.jsonl (one line per config
and shape: us, TB/s of the int4 weight bytes with scales and zeros, error) and prints the best config
per shape with its speed against bf16. --table-out writes each shape's fastest config as the tuned-config
table that w4a16_gemv.tuned_config reads (KVLLM_W4A16_GEMV_CONFIGS=FILE, or copied into
kvllm/layers/quantization/ops/w4a16_gemv_configs.json), keyed by this GPU's name.

Candidates are (block_n, block_k, warps, stages, split_k): split_k > 1 cuts K over that many programs per
column block (the fifteenth session's ncu run of the one-warp default on an H100: 1.4-3.5 warps per
scheduler, 8-21% occupancy, issue slots 24-38% busy, DRAM 16-27%: latency-bound for want of warps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128
# (block_n, block_k, warps, stages, split_k[, paired]). The fifteenth session's first H100 sweep: a split
# helps only without the shared-memory pipeline (stages 1: split 2 best on qkv, gate_up and down, 22-27%
# under the default), with it 2-4x slower; 4 columns beat 8 with 3 stages (ncu: 8-way bank conflicts on the
# pipeline's shared-memory reads at 8), and the gated kernel's two 4-column streams (1.71 TB/s) beat every
# one-stream config, hence `paired` (two streams of block_n columns for a plain projection).
# The second sweep: paired (4 columns, 3 stages) fastest on every plain projection; and the defaults without
# the L2 prefetch of the weight rows were faster for the gated kernel in both sweeps (36.3 / 36.5 us against
# 42.6 / 42.7), hence a seventh field, prefetch (on unless given), and no-prefetch twins of the leaders. The
# third sweep had every leader faster without it (10-20%): the launcher's default is now off.
CANDIDATES = [(8, 1024, 1, 3, 1), (4, 1024, 1, 3, 1), (8, 1024, 1, 1, 2), (4, 1024, 1, 1, 2)]
CANDIDATES += [(4, 1024, 1, s, 1, True) for s in (2, 3, 4)] + [(4, 512, 1, 3, 1, True)]
CANDIDATES += [(4, 1024, 1, s, 1, True, False) for s in (2, 3, 4)] + [(4, 512, 1, 3, 1, True, False)]
CANDIDATES += [(8, 1024, 1, 1, 2, False, False), (4, 1024, 1, 3, 1, False, False)]
GATED = [(4, 1024, 1, s, 1) for s in (2, 3)] + [(4, 512, 1, 3, 1), (2, 1024, 1, 3, 1)]
GATED += [(4, 1024, 1, s, 1, False, False) for s in (2, 3, 4)] + [(4, 512, 1, 3, 1, False, False)]
GATED += [
    (2, 1024, 1, 3, 1, False, False),
    (8, 1024, 1, 3, 1, False, False),
    (4, 1024, 1, 1, 2, False, False),
]


# --set next (written after the fifteenth session's last call, not run yet): the shipped configs (paired /
# gated, 4 columns, no prefetch) against the same with `flat_tile` (a row-major shared-memory copy: Triton
# orders the 4-D tile's copy otherwise, and ncu saw bank conflicts on its reads and writes), 8 columns
# again with it, and paired streams with K split too (qkv and o leave 4-6 one-warp programs per SM paired).
# The 16-byte copies of the weight tiles, lost to the split's offset in every config of this session's
# sweeps and restored since, apply to all of them.
NEXT = [
    (4, 1024, 1, 3, 1, True, False),
    (4, 1024, 1, 3, 1, True, False, True),
    (4, 512, 1, 3, 1, True, False, True),
]
NEXT += [(8, 1024, 1, s, 1, False, False, True) for s in (2, 3)] + [(8, 1024, 1, 3, 1, True, False, True)]
NEXT += [(4, 1024, 1, s, 2, True, False) for s in (1, 3)] + [(4, 1024, 1, 3, 2, True, False, True)]
NEXT += [
    (4, 512, 1, 1, 4, True, False),
    (4, 1024, 1, 1, 7, True, False),
    (4, 2048, 1, 3, 7, True, False, True),
]
NEXT_GATED = [(4, 512, 1, 3, 1, False, False), (4, 512, 1, 3, 1, False, False, True)]
NEXT_GATED += [(4, 1024, 1, 3, 1, False, False, True), (8, 1024, 1, 3, 1, False, False, True)]

# --set warps (sixteenth session, after `next` made flat_tile the plain projections' default): more warps per
# program (K split across them), deeper and shallower pipelines, and split K beside flat_tile.
WARPS = [(4, 1024, 1, 3, 1, True, False, True), (4, 512, 1, 3, 1, True, False, True)]
WARPS += [(4, 2048, 2, 3, 1, True, False, True), (8, 2048, 2, 3, 1, True, False, True)]
WARPS += [(4, 4096, 4, 3, 1, True, False, True), (4, 1024, 2, 3, 1, True, False, True)]
WARPS += [(4, 512, 1, s, 1, True, False, True) for s in (2, 4)] + [(4, 512, 1, 3, 2, True, False, True)]
WARPS_GATED = [
    (4, 512, 1, 3, 1, False, False),
    (4, 1024, 2, 3, 1, False, False),
    (4, 2048, 4, 3, 1, False, False),
]
WARPS_GATED += [
    (4, 512, 1, 4, 1, False, False),
    (2, 512, 1, 3, 1, False, False, True),
    (4, 256, 1, 4, 1, False, False),
]

# --set mma (twenty-seventh session): the tensor-core kernel (w4a16_gemv_mma.py; a ninth field, mma) against
# the defaults. Its first H100 sweep (with the group factors loaded in the tile that used them) ran faster
# the more programs were in flight: 16 columns with K split in two were best on qkv, o and down (10.9, 9.3,
# 24.5 us against the defaults' 10.8, 8.4, 21.7), 16 columns whole-K on the plain gate_up (31.5 against
# 33.8); 64 columns whole-K ran at 0.28-0.55 TB/s on qkv, o and down. Hence narrow programs and wide splits
# here, now that the factors come a tile ahead.
MMA = [(bn, 128, 1, 4, split, False, False, False, True) for bn in (16, 32, 64) for split in (1, 2, 4)]
MMA += [(bn, 128, 1, 4, 7, False, False, False, True) for bn in (16, 32, 64)]  # down only (K = 14336)
MMA += [(16, 128, 1, s, 2, False, False, False, True) for s in (3, 6)]
MMA += [(128, 128, 2, 4, 4, False, False, False, True), (16, 128, 1, 4, 8, False, False, False, True)]
# 64 columns a warp amortize the activations' permutation best (1.8 instructions a value against 2.3-2.9 at 16);
# deep splits give them the programs in flight (qkv 768 at split 8; down 896 at split 14).
MMA += [
    (bn, 128, 1, 4, split, False, False, False, True) for bn, split in ((64, 8), (32, 8), (64, 14), (64, 16))
]
MMA_GATED = [(bn, 128, 1, s, 1, False, False, False, True) for bn in (16, 32) for s in (3, 4, 6)]
MMA_GATED += [(64, 128, 2, 4, 1, False, False, False, True)]  # 64 columns at one warp spill (two streams)

# --set h200 (thirtieth session; the H200 has no tuned row, so it runs default_config, fit to an H100): the
# H100 table's configs, the CUDA-core kernel with deeper pipelines and longer tiles (more bytes in flight for
# the H200's bandwidth at the same latency), and the tensor-core kernel's leaders of the H100 sweeps.
H200 = [
    (4, 1024, 1, 3, 1, True, False, True),
    (4, 1024, 1, 4, 1, True, False, True),
    (4, 1024, 1, 5, 1, True, False, True),
    (4, 2048, 1, 3, 1, True, False, True),
    (4, 2048, 2, 4, 1, True, False, True),
    (4, 512, 1, 3, 2, True, False, True),
    (4, 512, 1, 4, 2, True, False, True),
    (4, 1024, 1, 4, 2, True, False, True),
]
H200 += [
    (bn, 128, 1, s, split, False, False, False, True) for bn, s, split in ((16, 4, 1), (16, 4, 2), (16, 6, 2))
]
H200 += [(bn, 128, 1, 4, split, False, False, False, True) for bn, split in ((32, 4), (64, 8), (64, 14))]
H200_GATED = [(4, 512, 1, s, 1, False, False) for s in (3, 4, 5)] + [(4, 1024, 1, 4, 1, False, False)]
H200_GATED += [(bn, 128, 1, s, 1, False, False, False, True) for bn, s in ((16, 4), (16, 6), (32, 4))]


def _config(cfg: tuple[int, ...]) -> Any:
    from kvllm.layers.quantization.ops.w4a16_gemv import W4A16GemvConfig

    block_n, block_k, warps, stages, split, *flags = cfg
    paired = bool(flags[0]) if flags else False
    prefetch = bool(flags[1]) if len(flags) > 1 else True
    flat = bool(flags[2]) if len(flags) > 2 else False
    mma = bool(flags[3]) if len(flags) > 3 else False
    return W4A16GemvConfig(block_n, block_k, warps, stages, prefetch=prefetch, split_k=split, paired=paired,
                           flat_tile=flat, mma=mma)  # fmt: skip


def _compile(job: tuple[tuple[int, int, int, int], int, bool]) -> str:
    """Compile one config for one K / gating in a worker (a CPU-side launch on a tiny weight)."""
    import torch

    from kvllm.layers.quantization.ops.int4_layout import pack_kernel_layout
    from kvllm.layers.quantization.ops.w4a16_gemv import w4a16_gemv, w4a16_gemv_silu_and_mul

    cfg, k, gated = job
    n = 2 * cfg[0]
    q = pack_kernel_layout(torch.randint(0, 16, (n, k), device="cuda"))
    s = torch.rand(n, k // GROUP, device="cuda").bfloat16()
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    fn = w4a16_gemv_silu_and_mul if gated else w4a16_gemv
    try:
        fn(x, q, s, s, GROUP, config=_config(cfg))
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # recorded by the timing pass
        return repr(e)[:200]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="gpu-out")
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--table-out", help="write the fastest config per shape as a tuned-config table")
    parser.add_argument(
        "--set", choices=["all", "next", "warps", "mma", "h200"], default="all", help="the candidate set"
    )
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    global CANDIDATES, GATED
    if args.set == "next":
        CANDIDATES, GATED = NEXT, NEXT_GATED
    elif args.set == "warps":
        CANDIDATES, GATED = WARPS, WARPS_GATED
    elif args.set == "mma":
        CANDIDATES, GATED = MMA, MMA_GATED
    elif args.set == "h200":
        CANDIDATES, GATED = H200, H200_GATED
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    jobs = [(c, k, False) for c in CANDIDATES for k in (4096, 14336) if k % (c[1] * c[4]) == 0]
    jobs += [(c, 4096, True) for c in GATED]
    import multiprocessing

    with ProcessPoolExecutor(
        min(16, os.cpu_count() or 4), mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        list(pool.map(_compile, jobs))
    print(f"compiled {len(jobs)} variants in {time.perf_counter() - start:.1f} s", flush=True)

    import torch

    from benchmarks.h200.quant_bench import copies, graph_us
    from kvllm.layers.ops.gemv import gemv, gemv_silu_and_mul
    from kvllm.layers.quantization.ops.int4_layout import dequantize, pack_kernel_layout
    from kvllm.layers.quantization.ops.w4a16_gemv import (
        default_config,
        tuned_key,
        w4a16_gemv,
        w4a16_gemv_silu_and_mul,
    )

    dev = torch.device("cuda")
    records: list[dict[str, Any]] = []
    log = open(out / "w4a16_gemv_m1.jsonl", "w")

    def emit(rec: dict[str, Any]) -> None:
        records.append(rec)
        line = json.dumps(rec)
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    for shape, (n, k) in shapes.items():

        def make_w4(n: int = n, k: int = k) -> tuple:
            q = pack_kernel_layout(torch.randint(0, 16, (n, k), device=dev))
            s = (torch.rand(n, k // GROUP, device=dev) * 0.003 + 0.001).bfloat16()
            z = torch.randint(0, 16, (n, k // GROUP), device=dev).bfloat16()
            return q, s, z

        w4_bytes = n * k // 2 + 2 * 2 * n * (k // GROUP)
        bf16 = copies(
            lambda n=n, k=k: (torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02,), n * k * 2
        )
        w4 = copies(make_w4, w4_bytes)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ dequantize(*w4[0], GROUP).T
        d = n // 2
        act = (
            torch.nn.functional.silu(ref[:, :d].bfloat16().float()).bfloat16().float()
            * ref[:, d:].bfloat16().float()
        )
        base = {"shape": shape, "m": 1, "n": n, "k": k}
        bf16_us = graph_us(lambda i, x=x, w=bf16: gemv(x, w[i % len(w)][0]))
        emit(
            base | {"impl": "bf16 GEMV", "us": round(bf16_us, 2), "tbps": round(n * k * 2 / bf16_us / 1e6, 3)}
        )
        if shape == "gate_up":
            us = graph_us(lambda i, x=x, w=bf16: gemv_silu_and_mul(x, w[i % len(w)][0]))
            emit(
                base | {"impl": "bf16 GEMV+silu", "us": round(us, 2), "tbps": round(n * k * 2 / us / 1e6, 3)}
            )
        # The defaults first (and with the L2 prefetch of the weight rows), so the budget never cuts them.
        variants = [("gemv", None), ("gemv", "prefetch")]
        if shape == "gate_up":
            variants += [("gemv+silu", None), ("gemv+silu", "prefetch")]
        variants += [("gemv", c) for c in CANDIDATES if k % (c[1] * c[4]) == 0] + (
            [("gemv+silu", c) for c in GATED] if shape == "gate_up" else []
        )
        for kind, cfg in variants:
            if time.perf_counter() - start > args.budget_s and cfg not in (None, "prefetch"):
                emit(base | {"impl": kind, "skipped": "budget"})
                break
            gated = kind == "gemv+silu"
            if cfg == "prefetch":  # the default with the L2 prefetch of the weight rows
                conf = dataclasses.replace(default_config(1, n, k, gated), prefetch=True)
            else:
                conf = _config(cfg) if cfg else default_config(1, n, k, gated)
            fn = w4a16_gemv_silu_and_mul if gated else w4a16_gemv
            rec = base | {"impl": f"w4a16 {kind}", "config": [conf.block_n, conf.block_k, conf.num_warps, conf.num_stages,
                          conf.split_k, conf.paired], "prefetch": conf.prefetch, "flat_tile": conf.flat_tile,
                          "mma": conf.mma, "default": cfg is None}  # fmt: skip
            try:
                got = fn(x, *w4[0], GROUP, config=conf).float()
                expected = act if gated else ref
                err = ((got - expected).abs().max() / expected.abs().max()).item()
                rec["max_rel_err"] = round(err, 5)
                if err > 2e-2:
                    rec["error"] = "wrong result"
                else:
                    us = graph_us(lambda i, f=fn, x=x, w=w4, c=conf: f(x, *w[i % len(w)], GROUP, config=c))
                    rec |= {
                        "us": round(us, 2),
                        "tbps": round(w4_bytes / us / 1e6, 3),
                        "vs_bf16": round(bf16_us / us, 2),
                    }
            except Exception as e:  # a config that does not compile or run: recorded
                rec["error"] = repr(e)[:300]
            emit(rec)
        bf16 = w4 = None
        torch.cuda.empty_cache()
    log.close()
    if args.table_out:
        table: dict[str, dict[str, Any]] = {}
        for rec in records:
            if "us" not in rec or not rec["impl"].startswith("w4a16"):
                continue
            key = tuned_key(1, rec["n"], rec["k"], rec["impl"].endswith("+silu"))
            if key not in table or rec["us"] < table[key]["us"]:
                table[key] = rec
        fields = ("block_n", "block_k", "num_warps", "num_stages", "split_k", "paired")
        entries = {
            key: dict(zip(fields, rec["config"]))
            | {"prefetch": rec["prefetch"], "flat_tile": rec["flat_tile"], "mma": rec.get("mma", False)}
            for key, rec in table.items()
        }
        Path(args.table_out).write_text(json.dumps({torch.cuda.get_device_name(): entries}, indent=1) + "\n")
        print(f"tuned-config table: {args.table_out}")
    print("\nbest per shape (M = 1):")
    for shape in shapes:
        for kind in ("w4a16 gemv", "w4a16 gemv+silu"):
            timed = [r for r in records if r.get("shape") == shape and r.get("impl") == kind and "us" in r]
            bf = [
                r for r in records if r.get("shape") == shape and r.get("impl") == "bf16 GEMV" and "us" in r
            ]
            if timed:
                best = min(timed, key=lambda r: r["us"])
                dflt = [r for r in timed if r.get("default")]
                print(f"{shape:8} {kind:16} best {best['config']}{' mma' if best.get('mma') else ''} {best['us']} us "
                      f"({best['tbps']} TB/s) "
                      f"default {dflt[0]['us'] if dflt else '-'} us; bf16 {bf[0]['us'] if bf else '-'} us")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
