"""End-to-end benchmark sweep for the H200, in one device call: kvllm per attention backend beside HF.

    PYTHONPATH=. python3 benchmarks/sweep_e2e.py --out "$OUT"

Model: Qwen3-0.6B shapes with random weights (`--load-format dummy`, bf16), from a config-only
folder written here. In priority order, each group in its own process (the engine takes 90% of
GPU memory; FlashInfer and FlashAttention-4 need different tvm-ffi versions), within a time budget:
  1. kvllm TRITON_ATTN: `bench latency` (in 32, out 128) and `bench throughput` (num_prompts = batch,
     in 128, out 128) at batch sizes 1, 8, 64, 256
  2. HF transformers `generate` (sdpa, bf16): the same throughput workloads
  3. nano-vllm's workload on kvllm (automatic backend choice)
  4. kvllm FLEX_ATTENTION, then FLASH_ATTN and FLASHINFER when their packages are importable
  5. nano-vllm's workload on HF transformers, if time is left
Each measurement is written as raw JSON to $OUT/raw as soon as it ends (so a timeout loses only the
measurement in flight); a summary table is printed last and saved to $OUT/summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

BATCH_SIZES = (1, 8, 64, 256)
LATENCY_LENS = (32, 128)  # input, output: vLLM's bench latency defaults
THROUGHPUT_LENS = (128, 128)
KVLLM_BACKENDS = ("TRITON_ATTN", "FLEX_ATTENTION", "FLASH_ATTN", "FLASHINFER")
# Seconds a group may take at most; the sweep's overall budget caps them further.
GROUP_CAPS_S = {"kvllm": 140.0, "hf": 90.0, "nano-kvllm": 100.0, "nano-hf": 240.0}
ENGINE_KWARGS: dict[str, Any] = {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": 4096}


def _latency_args(batch_size: int, iters: int, warmup: int, output_len: int) -> argparse.Namespace:
    return argparse.Namespace(
        input_len=LATENCY_LENS[0],
        output_len=output_len,
        batch_size=batch_size,
        n=1,
        num_iters_warmup=warmup,
        num_iters=iters,
        profile=False,
        profile_dir=None,
        profile_steps=None,
        disable_detokenize=False,
        output_json=None,
    )


def _throughput_args(
    backend: str,
    batch_size: int,
    dataset: str = "random",
    warmup: bool = True,
    output_len: int = THROUGHPUT_LENS[1],
) -> argparse.Namespace:
    return argparse.Namespace(
        backend=backend,
        dataset_name=dataset,
        input_len=THROUGHPUT_LENS[0],
        output_len=output_len,
        num_prompts=batch_size,
        random_range_ratio=0.0,
        hf_max_batch_size=batch_size if dataset == "random" else 256,
        hf_attn_implementation="sdpa",
        warmup=warmup,
        disable_detokenize=False,
        output_json=None,
    )


def _save(raw: Path, name: str, result: dict[str, Any]) -> None:
    raw.mkdir(parents=True, exist_ok=True)
    (raw / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"[sweep_e2e] wrote {name}.json", flush=True)


def _guarded(raw: Path, name: str, deadline: float, run: Any) -> None:
    """Run one measurement unless the deadline has passed; failures are recorded, not raised."""
    if time.time() > deadline:
        _save(raw, name, {"name": name, "skipped": "time budget used up"})
        return
    started = time.time()
    # Overwritten when the measurement ends; left behind if the group is killed at its time limit.
    _save(raw, name, {"name": name, "killed": "still running when its group hit the time limit"})
    try:
        result = run()
        result["name"] = name
        result["wall_s"] = time.time() - started
    except Exception as exc:
        result = {"name": name, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    _save(raw, name, result)


def worker(args: argparse.Namespace) -> int:
    """One group in this process: builds its engine or HF model once and runs its measurements."""
    from kvllm.benchmarks import latency, throughput

    raw, deadline = Path(args.raw), args.deadline
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine_kwargs = {
        **ENGINE_KWARGS,
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
    }
    if args.group == "kvllm":
        from kvllm.benchmarks.engine_runner import build_llm

        backend = args.backend
        try:
            llm = build_llm({**engine_kwargs, "attention_backend": backend}, enable_prefix_caching=False)
        except Exception as exc:
            _save(raw, f"kvllm-{backend}", {"name": f"kvllm-{backend}", "backend_unavailable": str(exc)})
            return 0
        for bs in batch_sizes:
            lat = _latency_args(bs, args.num_iters, 1, args.output_len)
            tput = _throughput_args("kvllm", bs, warmup=False, output_len=args.output_len)
            _guarded(
                raw,
                f"latency-{backend}-bs{bs}",
                deadline,
                lambda lat=lat: latency.measure_latency(llm, lat, quiet=True),
            )
            _guarded(
                raw,
                f"throughput-{backend}-bs{bs}",
                deadline,
                lambda tput=tput: throughput.measure_throughput(tput, engine_kwargs, llm=llm),
            )
    elif args.group == "hf":
        from kvllm.benchmarks.hf_backend import HFRunner
        from kvllm.config.engine import EngineArgs

        try:
            runner = HFRunner(EngineArgs(**engine_kwargs))
        except Exception as exc:
            _save(
                raw,
                "throughput-HF",
                {
                    "name": "throughput-HF",
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(),
                },
            )
            return 1
        for bs in batch_sizes:
            tput = _throughput_args("hf", bs, output_len=args.output_len)
            _guarded(
                raw,
                f"throughput-HF-bs{bs}",
                deadline,
                lambda tput=tput: throughput.measure_throughput(tput, engine_kwargs, hf_runner=runner),
            )
    elif args.group == "nano-kvllm":
        _guarded(
            raw,
            "nano-vllm-kvllm",
            deadline,
            lambda: throughput.measure_throughput(_throughput_args("kvllm", 256, "nano-vllm"), engine_kwargs),
        )
    elif args.group == "nano-hf":
        _guarded(
            raw,
            "nano-vllm-HF",
            deadline,
            lambda: throughput.measure_throughput(_throughput_args("hf", 256, "nano-vllm"), engine_kwargs),
        )
    return 0


def _run_group(group: str, backend: str | None, common: list[str], deadline: float, log: Path) -> None:
    cap = GROUP_CAPS_S[group]
    group_deadline = min(deadline, time.time() + cap)
    timeout = group_deadline - time.time() + 20  # past the deadline only the measurement in flight runs on
    if timeout <= 25:
        print(f"[sweep_e2e] skipping {group} {backend or ''}: time budget used up", flush=True)
        return
    cmd = [sys.executable, __file__, "worker", "--group", group, "--deadline", str(group_deadline), *common]
    if backend:
        cmd += ["--backend", backend]
    print(f"[sweep_e2e] {group} {backend or ''} (up to {timeout:.0f} s)", flush=True)
    started = time.time()
    with log.open("a") as out:
        try:
            subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            print(f"[sweep_e2e] {group} {backend or ''}: killed at its time limit", flush=True)
    print(f"[sweep_e2e] {group} {backend or ''} done in {time.time() - started:.0f} s", flush=True)


def _has_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def sweep(args: argparse.Namespace) -> int:
    out = Path(args.out)
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.budget_s
    from kvllm.benchmarks.model_shapes import write_shape_only_model

    model = args.model or write_shape_only_model("Qwen3-0.6B", Path(tempfile.mkdtemp(prefix="qwen3-0.6b-")))
    smi = (
        subprocess.run(["nvidia-smi"], capture_output=True, text=True, check=False).stdout
        if _which("nvidia-smi")
        else ""
    )
    (out / "nvidia-smi.txt").write_text(smi)
    common = [
        "--model",
        str(model),
        "--raw",
        str(raw),
        "--num-iters",
        str(args.num_iters),
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--batch-sizes",
        args.batch_sizes,
        "--output-len",
        str(args.output_len),
    ]
    log = out / "workers.log"
    backends = [b for b in args.backends.split(",") if b]
    optional = {"FLASH_ATTN": "flash_attn", "FLASHINFER": "flashinfer"}
    plan: list[tuple[str, str | None]] = []
    if backends:
        plan.append(("kvllm", backends[0]))
    if not args.skip_hf:
        plan.append(("hf", None))
    if not args.skip_nano_kvllm:
        plan.append(("nano-kvllm", None))
    for backend in backends[1:]:
        module = optional.get(backend)
        if module is not None and not _has_module(module):
            _save(
                raw,
                f"kvllm-{backend}",
                {"name": f"kvllm-{backend}", "backend_unavailable": f"{module} not installed"},
            )
            continue
        plan.append(("kvllm", backend))
    if not args.skip_nano_hf:
        plan.append(("nano-hf", None))
    for group, backend in plan:
        _run_group(group, backend, common, deadline, log)
    table = summary_table(raw, [int(b) for b in args.batch_sizes.split(",")])
    (out / "summary.md").write_text(table + "\n")
    print(table)
    return 0


def _which(name: str) -> bool:
    import shutil

    return shutil.which(name) is not None


def _load(raw: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(raw.glob("*.json"))}


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def summary_table(raw: Path, batch_sizes: list[int] | None = None) -> str:
    """Markdown tables: latency per backend and batch size; output tok/s per backend beside HF."""
    results = _load(raw)
    batch_sizes = batch_sizes or list(BATCH_SIZES)
    backends = sorted(
        {name.split("-")[1] for name in results if name.startswith(("latency-", "throughput-"))}
    )
    lines = [
        f"Latency, in {LATENCY_LENS[0]} / out {_output_len(results)} (avg s; decode output tok/s; GPU util)",
        "",
        "| backend | " + " | ".join(f"bs {b}" for b in batch_sizes) + " |",
        "|---|" + "---|" * len(batch_sizes),
    ]
    for backend in backends:
        cells = []
        for bs in batch_sizes:
            r = results.get(f"latency-{backend}-bs{bs}", {})
            if "avg_latency" in r:
                util = r.get("gpu_util")
                cells.append(
                    f"{r['avg_latency']:.3f} s; {_fmt(r['decode_throughput'])}; "
                    f"{'-' if util is None else f'{util * 100:.0f}%'}"
                )
            else:
                cells.append(_status(r))
        if any(c != "-" for c in cells):
            lines.append(f"| {backend} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Throughput, num_prompts = batch, in 128 (output tok/s; x HF)",
        "",
        "| backend | " + " | ".join(f"bs {b}" for b in batch_sizes) + " |",
        "|---|" + "---|" * len(batch_sizes),
    ]
    hf = {bs: results.get(f"throughput-HF-bs{bs}", {}).get("output_tokens_per_second") for bs in batch_sizes}
    for backend in backends:
        cells = []
        for bs in batch_sizes:
            r = results.get(f"throughput-{backend}-bs{bs}", {})
            rate = r.get("output_tokens_per_second")
            if rate is None:
                cells.append(_status(r))
            elif backend != "HF" and hf[bs]:
                cells.append(f"{rate:,.0f} ({rate / hf[bs]:.1f}x)")
            else:
                cells.append(f"{rate:,.0f}")
        lines.append(f"| {backend} | " + " | ".join(cells) + " |")
    lines += ["", "nano-vllm workload (256 seqs, in/out uniform 100-1024): output tok/s", ""]
    for name in ("nano-vllm-kvllm", "nano-vllm-HF"):
        r = results.get(name, {})
        rate = r.get("output_tokens_per_second")
        detail = f"{rate:,.0f} tok/s in {r['elapsed_time']:.1f} s" if rate else _status(r)
        lines.append(f"- {name}: {detail}")
    unavailable = {k: v["backend_unavailable"] for k, v in results.items() if "backend_unavailable" in v}
    for name, reason in unavailable.items():
        lines.append(f"- {name}: not run ({reason.splitlines()[0][:160]})")
    return "\n".join(lines)


def _output_len(results: dict[str, dict[str, Any]]) -> int | str:
    lens = {r["config"]["output_len"] for r in results.values() if r.get("benchmark") == "latency"}
    return lens.pop() if len(lens) == 1 else "?"


def _status(r: dict[str, Any]) -> str:
    if not r:
        return "-"
    if "error" in r:
        return "error"
    if "skipped" in r:
        return "skipped"
    if "killed" in r:
        return "timeout"
    return "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", default=os.environ.get("OUT", "bench-out"), help="Output folder (default: $OUT)."
    )
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="Overall time budget in seconds (default: 420)."
    )
    parser.add_argument(
        "--backends", default=",".join(KVLLM_BACKENDS), help="kvllm attention backends, in order."
    )
    parser.add_argument("--num-iters", type=int, default=3, help="Timed latency iterations (default: 3).")
    parser.add_argument("--skip-nano-hf", action="store_true", help="Do not run nano-vllm's workload on HF.")
    parser.add_argument("--skip-hf", action="store_true", help="Do not run the HF transformers group.")
    parser.add_argument(
        "--skip-nano-kvllm", action="store_true", help="Do not run nano-vllm's workload on kvllm."
    )
    parser.add_argument("--model", help="Model folder (default: a config-only Qwen3-0.6B, dummy weights).")
    sub = parser.add_subparsers(dest="mode", help="Without one: the whole sweep.")
    w = sub.add_parser("worker", help="Internal: one group of measurements.")
    w.add_argument("--group", required=True, choices=sorted(GROUP_CAPS_S))
    w.add_argument("--backend")
    w.add_argument("--model", required=True)
    w.add_argument("--raw", required=True)
    w.add_argument("--deadline", type=float, required=True)
    w.add_argument("--num-iters", type=int, default=3)
    summary = sub.add_parser("summary", help="Print the table of an earlier sweep's --out folder.")
    summary.add_argument("folder")
    for p in (parser, w, summary):
        # Small settings for a smoke test on the CPU with a tiny model; the defaults are the H200 sweep's.
        p.add_argument("--dtype", default="bfloat16")
        p.add_argument("--max-model-len", type=int, default=4096)
        p.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
        p.add_argument(
            "--output-len", type=int, default=LATENCY_LENS[1], help="Output tokens (default: 128)."
        )
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    if args.mode == "summary":
        print(summary_table(Path(args.folder) / "raw", [int(b) for b in args.batch_sizes.split(",")]))
        return 0
    return sweep(args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    raise SystemExit(main())
