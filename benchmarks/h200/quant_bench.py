"""Quantized weights on one GPU: kernels beside cuBLAS / torch._scaled_mm, and whole-model decode.

    PYTHONPATH=. python3 benchmarks/h200/quant_bench.py --out DIR [--parts kernels,e2e] [--quick] [--sweep]

kernels  Llama-3-8B's four projections (qkv, o, gate_up, down). Decode rows (M = 1, 16): bf16 F.linear
         (cuBLAS), kvllm's bf16 GEMV (M = 1) and small-M kernels, W4A16 (group 128) as the layers
         dispatch it (w4a16_linear: the GEMV at one row, the tensor-core GEMM at 2-512) and
         the Triton GEMM alone. Prefill/batch rows (M = 256, 1024): bf16 F.linear, fp8 per-channel W8A8
         through torch._scaled_mm (GEMM alone, and with kvllm's per-token activation quantization),
         block-fp8 (128x128) Triton GEMM with its activation quantization, W4A16. Each time is the median
         per call of a CUDA graph of LOOP calls, each reading another copy of the weight (together more
         than the L2), as consecutive layers do. TB/s counts the weight bytes (packed values + scales +
         zeros) plus x and y once; TFLOP/s = 2 M N K / time.
e2e      Llama-3-8B-shaped model, dummy weights generated on the GPU, bf16 activations, CUDA graphs, one
         engine per subprocess: bf16, awq (W4A16 from a config with AWQ's quantization_config), fp8
         (online per-channel from the bf16 dummy weights), fp8-block (quantization_config with
         weight_block_size [128, 128]), fp8-tensor (a per-tensor fp8 checkpoint's quantization_config);
         named only: awq-pdl (awq with the decode GEMV under programmatic dependent launch), awq-before (awq
         without the tensor-core GEMM: w4a16.MMA_GEMM_MAX_ROWS = 0, the routes before it), awq-gemv4 (awq
         with the GEMV for 1-4 rows, the GEMM from 5: w4a16.MMA_GEMM_MIN_ROWS = 5, as before the twenty-
         ninth session). Batch 1: 32 random prompt tokens, 128 output tokens, EOS ignored, ms per output
         token = wall time / 128 (median of 3 after a warm-up); batch 4 the same with 4 prompts, ms per
         decode step (wall time / 128). Batch 256: 256 x 128 in / 128 out, output tokens per
         second (after a warm-up batch). --profile: one more batch-1 request per engine under
         torch.profiler, its kernel table in DIR/e2e-profile-<engine>.txt (where a step's time goes).
fp8probe torch's blockwise-scaled F.scaled_mm (1x128 x 128x128) on Llama-3-8B shapes at M = 256: which
         scale layouts run, error against float32, time beside the block-fp8 Triton GEMM.
--sweep  the W4A16 launch-config sweep of benchmarks/h200/w4a16_sweep.py (after e2e; GEMV at M = 1, 2, 4,
         GEMM tiles and dequantize + cuBLAS at M = 16 .. 256, Llama-3-8B and Qwen3-0.6B shapes), bounded
         by --sweep-budget seconds; its own JSONL and summary.
One JSON line per measurement goes to DIR/quant_bench.jsonl; a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
DECODE_ROWS = (1, 16)
GEMM_ROWS = (256, 1024)
LOOP, REPLAYS = 20, 10
COLD_BYTES = 256 << 20
GROUP = 128
ENGINES = {
    "bf16": (None, None),
    "awq": (
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
        None,
    ),
    "fp8": (None, "fp8"),
    "fp8-block": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        None,
    ),
    "fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, None),
}
# Variants of an engine above, run only when named in --engines: AWQ with its decode GEMV launched under
# programmatic dependent launch (w4a16_gemv.LAUNCH_WITH_PDL, off since the eleventh session measured the
# kernel of then slower with it).
VARIANTS = {"awq-pdl": "awq", "awq-before": "awq", "awq-gemv4": "awq"}


def graph_us(fn: Callable[[int], Any]) -> float:
    from benchmarks.h200.graph_timing import graph_call_ms

    return graph_call_ms(fn, LOOP, REPLAYS) * 1e3


def copies(make: Callable[[], tuple], nbytes: int) -> list[tuple]:
    return [make() for _ in range(max(2, min(LOOP, -(-COLD_BYTES // nbytes))))]


def kernel_records(quick: bool) -> list[dict[str, Any]]:
    import torch

    records: list[dict[str, Any]] = []
    for shape, (n, k) in SHAPES.items():
        for m in DECODE_ROWS + GEMM_ROWS:
            if not quick or m in (1, 256):
                records += bench_rows(shape, m, n, k, quick)
        torch.cuda.empty_cache()
    return records


def bench_rows(shape: str, m: int, n: int, k: int, quick: bool) -> list[dict[str, Any]]:
    """Every implementation at one shape and row count (fresh weights: nothing kept across calls)."""
    import torch
    import torch.nn.functional as F

    from kvllm.layers.ops.linear import linear as small_m_linear
    from kvllm.layers.quantization.fp8 import quantize_per_channel
    from kvllm.layers.quantization.ops.fp8 import FP8, block_fp8_linear, quantize_fp8, scaled_mm_rowwise
    from kvllm.layers.quantization.ops.int4_layout import pack_kernel_layout
    from kvllm.layers.quantization.ops.w4a16 import default_config, w4a16_linear, w4a16_triton

    dev = torch.device("cuda")
    records: list[dict[str, Any]] = []

    def emit(impl: str, us: float, weight_bytes: int, **extra: Any) -> None:
        moved = weight_bytes + 2 * m * (k + n)
        rec = {"part": "kernels", "shape": shape, "m": m, "n": n, "k": k, "impl": impl, "us": round(us, 2),
               "tbps": round(moved / us / 1e6, 3), "tflops": round(2 * m * n * k / us / 1e6, 1), **extra}  # fmt: skip
        records.append(rec)
        print(json.dumps(rec), flush=True)

    def make_w4() -> tuple:
        q = pack_kernel_layout(torch.randint(0, 16, (n, k), device=dev))
        s = (torch.rand(n, k // GROUP, device=dev) * 0.003).bfloat16()
        z = torch.randint(0, 16, (n, k // GROUP), device=dev).bfloat16()
        return q, s, z

    bf16_bytes = n * k * 2
    w4_bytes = n * k // 2 + 2 * 2 * n * (k // GROUP)
    bf16_w = copies(lambda: (torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02,), bf16_bytes)
    w4 = copies(make_w4, w4_bytes)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    emit("bf16 F.linear", graph_us(lambda i: F.linear(x, bf16_w[i % len(bf16_w)][0])), bf16_bytes)
    if m == 1:
        from kvllm.layers.ops.gemv import gemv

        emit("bf16 GEMV kernel", graph_us(lambda i: gemv(x, bf16_w[i % len(bf16_w)][0])), bf16_bytes)
    if m <= 16:
        emit(
            "bf16 small-M kernel",
            graph_us(lambda i: small_m_linear(x, bf16_w[i % len(bf16_w)][0])),
            bf16_bytes,
        )
    variants = {
        "w4a16": lambda i: w4a16_linear(x, *w4[i % len(w4)], GROUP),
        "w4a16 Triton GEMM": lambda i: w4a16_triton(x, *w4[i % len(w4)], GROUP, config=default_config(m, n, k, GROUP)),
    }  # fmt: skip
    for name, fn in variants.items():
        try:
            us = graph_us(fn)
        except Exception as e:  # a variant that does not compile here: recorded, not fatal
            print(json.dumps({"shape": shape, "m": m, "impl": name, "error": repr(e)[:300]}), flush=True)
            continue
        emit(name, us, w4_bytes)
    if m >= 256:
        fp8_w = copies(lambda: quantize_per_channel(bf16_w[0][0]), n * k)
        xq, xs = quantize_fp8(x)
        emit("fp8 _scaled_mm (GEMM only)", graph_us(lambda i: torch._scaled_mm(
            xq, fp8_w[i % len(fp8_w)][0].t(), scale_a=xs, scale_b=fp8_w[i % len(fp8_w)][1].view(1, -1),
            out_dtype=torch.bfloat16)), n * k)  # fmt: skip
        emit("fp8 W8A8 per-channel (quant + _scaled_mm)",
             graph_us(lambda i: scaled_mm_rowwise(x, *fp8_w[i % len(fp8_w)], None)), n * k)  # fmt: skip
        blocks = copies(lambda: (torch.randn(n, k, device=dev).to(FP8),
                                 torch.rand(n // 128, k // 128, device=dev) * 0.01), n * k)  # fmt: skip
        emit("fp8 W8A8 block 128x128 (quant + Triton)",
             graph_us(lambda i: block_fp8_linear(x, *blocks[i % len(blocks)], (128, 128))), n * k)  # fmt: skip
    return records


def fp8_block_probe(m: int = 256) -> list[dict[str, Any]]:
    """Whether torch's blockwise-scaled GEMM (F.scaled_mm, BlockWise1x128 activations x BlockWise128x128
    weights) runs here, for which scale layouts, how close it is to float32 and how fast, beside
    kvllm's block-fp8 Triton GEMM and the per-channel _scaled_mm (Llama-3-8B shapes, M rows)."""
    records: list[dict[str, Any]] = []
    for shape, (n, k) in SHAPES.items():
        found = _fp8_probe_shape(shape, m, n, k)
        for r in found:
            print(json.dumps(r), flush=True)
        records += found
    return records


def _fp8_probe_shape(shape: str, m: int, n: int, k: int) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from kvllm.layers.quantization.fp8 import quantize_per_channel
    from kvllm.layers.quantization.ops.fp8 import FP8, block_fp8_linear, dequantize_block, quantize_fp8

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.5).to(FP8)
    ws = torch.rand(n // 128, k // 128, device="cuda") * 0.01 + 0.001
    xq, xs = quantize_fp8(x, 128)
    ref = (xq.float() * xs.repeat_interleave(128, 1)) @ dequantize_block(w, ws, (128, 128)).T
    base = {"part": "fp8probe", "shape": shape, "m": m, "n": n, "k": k}
    records = [base | {"impl": "block Triton (quant + GEMM)",
                       "us": graph_us(lambda i: block_fp8_linear(x, w, ws, (128, 128)))}]  # fmt: skip
    wc, sc = quantize_per_channel((w.float() * 0.01).bfloat16())
    xq1, xs1 = quantize_fp8(x)
    records.append(base | {"impl": "per-channel _scaled_mm (GEMM only)", "us": graph_us(
        lambda i: torch._scaled_mm(xq1, wc.t(), scale_a=xs1, scale_b=sc.view(1, -1), out_dtype=torch.bfloat16))})  # fmt: skip
    scaling = getattr(F, "ScalingType", None)
    layouts = {
        "xs row-major, ws row-major": (xs, ws),
        "xs M-major, ws row-major": (xs.t().contiguous().t(), ws),
        "xs M-major, ws K-major": (xs.t().contiguous().t(), ws.t().contiguous().t()),
        "xs M-major, ws^T": (xs.t().contiguous().t(), ws.t()),
        "xs M-major, ws^T contiguous": (xs.t().contiguous().t(), ws.t().contiguous()),
    }
    for name, (sa, sb) in layouts.items():
        rec = base | {"impl": f"F.scaled_mm blockwise ({name})"}
        try:
            if scaling is None:
                raise RuntimeError("this torch has no F.ScalingType")

            def call(i: int, sa: Any = sa, sb: Any = sb) -> Any:
                return F.scaled_mm(xq, w.t(), sa, scaling.BlockWise1x128, sb, scaling.BlockWise128x128,
                                   output_dtype=torch.bfloat16)  # fmt: skip

            err = ((call(0).float() - ref).abs().max() / ref.abs().max()).item()
            rec["max_rel_err"] = round(err, 5)
            if err < 2e-2:
                rec["us"] = graph_us(call)
        except Exception as e:  # not available for this layout / torch / GPU: recorded
            rec["error"] = repr(e)[:300]
        records.append(rec)
    for r in records:
        if "us" in r:
            r["us"] = round(r["us"], 2)
            r["tflops"] = round(2 * m * n * k / r["us"] / 1e6, 1)
    return records


def engine_child(
    name: str, folder: str, quantization: str | None, quick: bool, profile_dir: str | None = None
) -> None:
    """One engine: batch-1 latency and batch-256 throughput (and with `profile_dir` one more batch-1
    request under torch.profiler: its kernel table in e2e-profile-<name>.txt); JSON lines on stdout."""
    import torch

    from kvllm import LLM, SamplingParams
    from kvllm.benchmarks.datasets import random_requests

    if name == "awq-pdl":
        from kvllm.layers.quantization.ops import w4a16_gemv

        w4a16_gemv.LAUNCH_WITH_PDL = True
    if name == "awq-before":
        from kvllm.layers.quantization.ops import w4a16

        w4a16.MMA_GEMM_MAX_ROWS = 0
    if name == "awq-gemv4":
        from kvllm.layers.quantization.ops import w4a16

        w4a16.MMA_GEMM_MIN_ROWS = 5
    start = time.perf_counter()
    llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=256,
              enable_prefix_caching=False, quantization=quantization)  # fmt: skip
    startup = time.perf_counter() - start
    vocab = 128256
    params = SamplingParams(max_tokens=128, temperature=1.0, ignore_eos=True)

    def run(batch: int, seed: int) -> float:
        requests = random_requests(batch, 32 if batch <= 4 else 128, 128, vocab, seed=seed)
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(1, 0)
    ms_per_token = statistics.median(run(1, seed) for seed in range(1, 2 if quick else 4)) / 128 * 1e3
    run(4, 20)
    ms_per_step_4 = statistics.median(run(4, seed) for seed in range(21, 22 if quick else 24)) / 128 * 1e3
    profile = None
    if profile_dir:
        from benchmarks.h200.torch_profile import profile_call

        table = Path(profile_dir) / f"e2e-profile-{name}.txt"
        profile = profile_call(lambda: run(1, 99), table, f"{name}, batch 1, 128 output tokens")
    run(256, 10)
    wall = run(256, 11)
    record = {"part": "e2e", "engine": name, "startup_s": round(startup, 1),
              "batch1_ms_per_token": round(ms_per_token, 3), "batch4_ms_per_step": round(ms_per_step_4, 3),
              "batch256_output_tok_s": round(256 * 128 / wall, 1),
              "weight_gib": round(torch.cuda.memory_allocated() / 2**30, 2), "gpu": torch.cuda.get_device_name()}  # fmt: skip
    if profile is not None:
        record["batch1_profile"] = profile
    print("RECORD " + json.dumps(record), flush=True)


def e2e_records(
    out: Path, engines: list[str], quick: bool, timeout_s: float, profile: bool = False
) -> list[dict[str, Any]]:
    from kvllm.benchmarks.model_shapes import write_shape_only_model

    records = []
    for name in engines:
        config, quantization = ENGINES[VARIANTS.get(name, name)]
        folder = write_shape_only_model("Llama-3-8B", out / "models" / name, config)
        cmd = [sys.executable, __file__, "--child", name, "--folder", str(folder)]
        cmd += ["--quantization", quantization] if quantization else []
        cmd += ["--quick"] if quick else []
        cmd += ["--profile-dir", str(out)] if profile else []
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            log = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            log = f"timed out after {timeout_s} s\n{e.stdout or ''}{e.stderr or ''}"
        (out / f"e2e-{name}.log").write_text(log if isinstance(log, str) else str(log))
        lines = [line for line in str(log).splitlines() if line.startswith("RECORD ")]
        record = (
            json.loads(lines[-1][7:]) if lines else {"part": "e2e", "engine": name, "error": str(log)[-2000:]}
        )
        print(json.dumps(record), flush=True)
        records.append(record)
    return records


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="gpu-out")
    parser.add_argument("--parts", default="kernels,e2e")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="the W4A16 launch-config sweep first")
    parser.add_argument(
        "--sweep-budget", type=float, default=100.0, help="seconds the sweep may start configs"
    )
    parser.add_argument("--engine-timeout", type=float, default=150.0)
    parser.add_argument(
        "--profile", action="store_true", help="e2e: one more batch-1 request per engine under torch.profiler"
    )
    parser.add_argument("--profile-dir", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--quantization", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        engine_child(args.child, args.folder, args.quantization, args.quick, args.profile_dir)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    records = []
    if "e2e" in parts:  # first: the engines run in their own processes on an idle GPU
        records += e2e_records(out, args.engines.split(","), args.quick, args.engine_timeout, args.profile)
    if args.sweep:
        from benchmarks.h200.w4a16_sweep import sweep

        sweep(out, args.sweep_budget)
    records += kernel_records(args.quick) if "kernels" in parts else []
    if "fp8probe" in parts:
        records += fp8_block_probe()
    with open(out / "quant_bench.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    print_table(records)
    return 0


def print_table(records: list[dict[str, Any]]) -> None:
    print(f"\n{'shape':8} {'M':>5} {'impl':48} {'us':>9} {'TB/s':>6} {'TFLOP/s':>8}")
    for r in records:
        if r.get("part") == "kernels":
            print(
                f"{r['shape']:8} {r['m']:>5} {r['impl'][:48]:48} {r['us']:>9.1f} {r['tbps']:>6.2f} {r['tflops']:>8.1f}"
            )
    e2e = {r["engine"]: r for r in records if r.get("part") == "e2e" and "error" not in r}
    for r in records:
        if r.get("part") == "e2e":
            if "error" in r:
                print(f"e2e {r['engine']}: ERROR (see e2e-{r['engine']}.log)")
                continue
            base = e2e.get("bf16")
            speed = ""
            if base:
                speed = (f"  batch-1 {base['batch1_ms_per_token'] / r['batch1_ms_per_token']:.2f}x, "
                         f"batch-256 {r['batch256_output_tok_s'] / base['batch256_output_tok_s']:.2f}x vs bf16")  # fmt: skip
            batch4 = f", batch-4 {r['batch4_ms_per_step']:.2f} ms/step" if "batch4_ms_per_step" in r else ""
            print(f"e2e {r['engine']:10} batch-1 {r['batch1_ms_per_token']:.2f} ms/token{batch4}, batch-256 "
                  f"{r['batch256_output_tok_s']:.0f} tok/s, weights {r['weight_gib']} GiB{speed}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
