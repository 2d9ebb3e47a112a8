"""TRITON_ATTN prefill kernel sweep (and batch-1 long-context decode) on one GPU.

Times every candidate tile config of the prefill kernel (`kvllm/attention/ops/triton_prefill_attention.py`)
and of the unified kernel's prefill launch on the standard prefill shapes, the split-KV decode
configs on batch 1 x 32k, beside torch SDPA (flash) and, when importable, FlashAttention-4 and
FlashInfer (staged separately, never required). Every candidate is checked against the float32
reference before it is timed (relative L2 error < 1.5e-2 in bf16); a candidate that fails to
compile, crashes or is wrong is a row with that status, not the end of the run.

Compiling is the slow part on a fresh machine: worker processes compile (and run once) all
candidates in parallel first, filling Triton's cache; a worker that dies marks its unfinished
candidates "crash". Then this process checks and times them one by one.

    PYTHONPATH=. python benchmarks/h200/prefill_sweep.py --out-dir $OUT        # GPU, < 4 minutes
    PYTHONPATH=. python benchmarks/h200/prefill_sweep.py --tiny --out-dir /tmp  # CPU interpreter smoke run

Writes `prefill_sweep.jsonl` (one JSON object per row, the first one the run's environment) and
prints a table and, per shape, the fastest candidate.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

from kvllm.benchmarks.attention.shapes import Group, Shape

TARGET_TFLOPS = 350.0  # issue 23: TRITON_ATTN prefill on the standard 8 x 2048 causal shape
TOLERANCE = {"bfloat16": 1.5e-2, "float16": 3e-3, "float32": 1e-4}


@dataclass(frozen=True)
class SweepShape:
    name: str
    groups: tuple[Group, ...]
    num_heads: int = 16  # Qwen3-0.6B: 16 query / 8 KV heads of 128
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    decode: bool = False

    @property
    def shape(self) -> Shape:
        return Shape(self.name, self.groups)


# The standard shape first and the batch-1 decode second: a run cut short by its time budget keeps them.
GPU_SHAPES = (
    SweepShape("qwen3 8x2048 causal", (Group(8, 2048, 0),)),
    SweepShape("qwen3 decode 1 x 32k", (Group(1, 1, 32767),), decode=True),
    SweepShape("llama8b 8x2048 causal", (Group(8, 2048, 0),), num_heads=32),
    SweepShape("qwen3 8x2048 causal, block 64", (Group(8, 2048, 0),), block_size=64),
    SweepShape("qwen3 4x1024 over 3072 cached", (Group(4, 1024, 3072),)),
    SweepShape("qwen3 32x512 causal", (Group(32, 512, 0),)),
    SweepShape("qwen3 1x8192 causal", (Group(1, 8192, 0),)),
    # Where the prefill kernel starts to beat the unified one (its routing threshold): shorter chunks.
    SweepShape("qwen3 64x128 causal", (Group(64, 128, 0),)),
    SweepShape("qwen3 32x256 causal", (Group(32, 256, 0),)),
    SweepShape("qwen3 8x1024 causal", (Group(8, 1024, 0),)),
    SweepShape("qwen3 2x4096 causal", (Group(2, 4096, 0),)),
)
TINY_SHAPES = (
    SweepShape("tiny 2x80 causal", (Group(2, 80, 0),), 4, 2, 64),
    SweepShape("tiny 1x40 over 50, block 32", (Group(1, 40, 50),), 4, 2, 64, block_size=32),
    SweepShape("tiny decode 1 x 300", (Group(1, 1, 299),), 4, 2, 64, decode=True),
)


# --quick (about 40 s on a fresh H200): the standard shape and the batch-1 decode, the current kernel
# and the candidates most likely to win; block 64 checks the table's TMA page loads (defaults only).
QUICK_SHAPES = ("qwen3 8x2048 causal", "qwen3 decode 1 x 32k", "qwen3 8x2048 causal, block 64")
QUICK_CANDIDATES = (
    "unified default",
    "prefill default",
    "prefill m128-n64-w8-s3-gather",
    "prefill m128-n128-w8-s2-gather",
    "prefill m128-n64-w8-s2-gather-newkv",
    "prefill m128-n128-w8-s2-gather-newkv",
    "prefill m128-n64-w4-s2-gather-newkv",
    "prefill m64-n64-w4-s3-gather-newkv",
    "prefill m128-n64-w8-s3-gather-pack-newkv",
    "prefill m128-n64-w8-s3-gather-ws-newkv",
    "decode default splits 64",
    "decode default splits 32",
    "decode m16-n128-w4-s2 splits 64",
)


@dataclass(frozen=True)
class Candidate:
    name: str
    kind: str  # "prefill" (the prefill kernel), "unified" (the unified kernel's prefill launch), "decode"
    cfg: object  # PrefillConfig or KernelConfig
    num_splits: int = 1  # decode only
    paged_only: bool = False  # prefill: only on the shapes with pages over 16 tokens (page / TMA loads)

    def applies(self, s: SweepShape) -> bool:
        if s.decode != (self.kind == "decode"):
            return False
        if self.kind == "prefill" and self.paged_only:
            return s.block_size > 16
        if s.block_size > 16:  # the large-page shapes: their own candidates plus the defaults
            return self.name in ("prefill default", "unified default")
        return True


def candidates(tiny: bool) -> list[Candidate]:
    from kvllm.attention.ops.triton_prefill_config import PrefillConfig
    from kvllm.attention.ops.triton_unified_attention import KernelConfig

    out: list[Candidate] = [
        Candidate("prefill default", "prefill", None),
        Candidate("unified default", "unified", None),
    ]
    if tiny:
        out += [
            Candidate("prefill m32-n16 gather", "prefill", PrefillConfig(32, 16, 4, 1)),
            Candidate("prefill m32-n16 newkv", "prefill", PrefillConfig(32, 16, 4, 1, new_kv=True)),
            Candidate(
                "prefill m32-n16 tma", "prefill", PrefillConfig(32, 16, 4, 1, kv_load="tma"), paged_only=True
            ),
            Candidate("decode splits 4", "decode", KernelConfig(16, 16, 2, 1), num_splits=4),
        ]
        return out
    out.append(Candidate("unified m128-n64-w8-s3", "unified", KernelConfig(128, 64, 8, 3)))
    out.append(Candidate("unified m128-n128-w8-s2", "unified", KernelConfig(128, 128, 8, 2)))
    pre = [
        PrefillConfig(128, 64, 8, 2),
        PrefillConfig(128, 64, 8, 3),
        PrefillConfig(128, 64, 8, 4),
        PrefillConfig(128, 128, 8, 2),
        PrefillConfig(128, 128, 8, 3),
        PrefillConfig(128, 64, 4, 2),
        PrefillConfig(128, 64, 4, 3),
        PrefillConfig(128, 32, 4, 3),
        PrefillConfig(64, 64, 4, 2),
        PrefillConfig(64, 64, 4, 3),
        PrefillConfig(64, 128, 4, 2),
        PrefillConfig(128, 64, 8, 2, pack_gqa=True),
        PrefillConfig(128, 64, 8, 3, pack_gqa=True),
        PrefillConfig(128, 128, 8, 2, pack_gqa=True),
        PrefillConfig(128, 64, 4, 3, pack_gqa=True),
        PrefillConfig(64, 64, 4, 3, pack_gqa=True),
        PrefillConfig(256, 64, 8, 2, pack_gqa=True),
        PrefillConfig(256, 32, 8, 2, pack_gqa=True),
        PrefillConfig(128, 64, 8, 2, warp_specialize=True),
        PrefillConfig(128, 64, 8, 3, warp_specialize=True),
        PrefillConfig(128, 128, 8, 2, warp_specialize=True),
        PrefillConfig(128, 64, 8, 3, pack_gqa=True, warp_specialize=True),
        PrefillConfig(128, 64, 8, 2, new_kv=True),
        PrefillConfig(128, 64, 8, 3, new_kv=True),
        PrefillConfig(128, 128, 8, 2, new_kv=True),
        PrefillConfig(128, 128, 8, 3, new_kv=True),
        PrefillConfig(128, 64, 4, 2, new_kv=True),
        PrefillConfig(64, 64, 4, 3, new_kv=True),
        PrefillConfig(128, 64, 8, 3, pack_gqa=True, new_kv=True),
        PrefillConfig(128, 64, 8, 3, warp_specialize=True, new_kv=True),
        PrefillConfig(128, 128, 8, 2, warp_specialize=True, new_kv=True),
    ]
    out += [Candidate(f"prefill {c.label}", "prefill", c) for c in pre]
    paged = [
        PrefillConfig(128, 64, 8, 2, kv_load="tma"),
        PrefillConfig(128, 64, 8, 3, kv_load="tma"),
        PrefillConfig(128, 64, 8, 4, kv_load="tma"),
        PrefillConfig(128, 64, 4, 3, kv_load="tma"),
        PrefillConfig(128, 64, 8, 3, kv_load="tma", pack_gqa=True),
        PrefillConfig(128, 64, 8, 2, kv_load="tma", warp_specialize=True),
        PrefillConfig(128, 64, 8, 3, kv_load="tma", warp_specialize=True),
        PrefillConfig(128, 64, 8, 3, kv_load="page"),
        PrefillConfig(128, 64, 8, 3, kv_load="gather"),
        PrefillConfig(128, 64, 8, 3, kv_load="tma", new_kv=True),
        PrefillConfig(128, 64, 8, 3, kv_load="tma", new_kv=True, warp_specialize=True),
    ]
    out += [Candidate(f"prefill {c.label}", "prefill", c, paged_only=True) for c in paged]
    for splits in (16, 32, 64):
        out.append(Candidate(f"decode default splits {splits}", "decode", None, num_splits=splits))
        for cfg in (KernelConfig(16, 128, 4, 2), KernelConfig(16, 64, 4, 3), KernelConfig(16, 128, 4, 3)):
            label = f"m{cfg.block_m}-n{cfg.tile_n}-w{cfg.num_warps}-s{cfg.num_stages}"
            out.append(Candidate(f"decode {label} splits {splits}", "decode", cfg, num_splits=splits))
    return out


# ---- one case: a random paged batch and the call of one candidate on it -----------------------


@dataclass
class Case:
    shape: SweepShape
    batch: object
    kv_cache: object
    metadata: object
    ref: object = None
    extra: dict = field(default_factory=dict)


def build_case(s: SweepShape, dtype, device) -> Case:
    import torch

    from kvllm.attention.backends.triton_attn import TritonAttentionBackend
    from kvllm.attention.backends.triton_attn_impl import TritonAttentionMetadataBuilder
    from kvllm.attention.metadata import KVCacheSpec
    from kvllm.attention.ops.triton_reshape_and_cache import reshape_and_cache
    from kvllm.attention.reference import make_paged_batch

    qlens, ctxs = s.shape.requests()
    batch = make_paged_batch(qlens, ctxs, s.num_heads, s.num_kv_heads, s.head_size, s.block_size,
                             dtype=dtype, device=device, seed=0)  # fmt: skip
    kv_cache = torch.zeros(2, batch.num_blocks, s.block_size, s.num_kv_heads, s.head_size, dtype=dtype,
                           device=device)  # fmt: skip
    batch.fill_cache(kv_cache[0], kv_cache[1])
    one = torch.tensor(1.0, device=device)
    reshape_and_cache(batch.new_keys, batch.new_values, kv_cache[0], kv_cache[1], batch.metadata.slot_mapping,
                      one, one)  # fmt: skip
    md = batch.metadata
    # The step's K/V as the engine passes them: strided views of one fused qkv projection output.
    qkv = torch.empty(
        md.num_actual_tokens, s.num_heads + 2 * s.num_kv_heads, s.head_size, dtype=dtype, device=device
    )
    key, value = qkv[:, s.num_heads : s.num_heads + s.num_kv_heads], qkv[:, s.num_heads + s.num_kv_heads :]
    key.copy_(batch.new_keys)
    value.copy_(batch.new_values)
    spec = KVCacheSpec(s.block_size, s.num_kv_heads, s.head_size, dtype, "auto")
    builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, device, md.num_reqs,
                                             md.num_actual_tokens, md.max_seq_len + s.block_size)  # fmt: skip
    return Case(s, batch, kv_cache, builder.build(md), extra={"key": key, "value": value})


def candidate_fn(case: Case, cand: Candidate):
    """(fn, out, note): fn runs the candidate once into out."""
    import torch

    from kvllm.attention.ops.triton_prefill_config import (
        prefill_kernel_config,
        resolve_kv_load,
        resolve_new_kv_load,
    )
    from kvllm.attention.ops.triton_unified_attention import prefill_config, unified_attention

    s, tm, kv = case.shape, case.metadata, case.kv_cache
    out = torch.empty_like(case.batch.query)
    scale = s.head_size**-0.5
    g = s.num_heads // s.num_kv_heads
    dtype = case.batch.query.dtype
    dec_cfg = pre_cfg = None
    splits = tm.num_splits
    if cand.kind == "prefill":
        pre_cfg = cand.cfg or prefill_kernel_config(s.head_size, g, dtype, s.block_size)
        new = resolve_new_kv_load(pre_cfg, case.extra["key"], case.extra["value"], kv[0])
        note = f"{pre_cfg.label}, loads {resolve_kv_load(pre_cfg, kv[0], kv[1], s.head_size)}" + (
            f"+{new}" if new else ""
        )
    elif cand.kind == "unified":
        pre_cfg = cand.cfg or prefill_config(s.head_size, g, dtype)
        note = f"unified m{pre_cfg.block_m}-n{pre_cfg.tile_n}-w{pre_cfg.num_warps}-s{pre_cfg.num_stages}"
    else:
        dec_cfg = cand.cfg
        splits = cand.num_splits
        note = f"splits={splits} (builder's choice {tm.num_splits})"
    one = torch.tensor(1.0, device=kv.device)

    def fn():
        unified_attention(
            out, case.batch.query, kv[0], kv[1], tm.query_start_loc, tm.seq_lens, tm.block_table,
            num_reqs=tm.num_reqs, num_tokens=tm.num_actual_tokens, num_decode_reqs=tm.num_decode_reqs,
            scale=scale, k_scale=one, v_scale=one, num_splits=splits, decode_cfg=dec_cfg, prefill_cfg=pre_cfg,
            key=case.extra["key"], value=case.extra["value"],
        )  # fmt: skip

    return fn, out, note


def peer_fns(case: Case, peers: list[str], on_gpu: bool):
    """(label, fn, out, note) or (label, None, None, why) for the library peers, via the attention benchmark's."""
    from kvllm.benchmarks.attention.peers import Peers

    s = case.shape
    args = argparse.Namespace(num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_size=s.head_size,
                              block_size=s.block_size, kv_cache_dtype="auto", sweep=False)  # fmt: skip
    p = Peers(args, case.batch.query.dtype, case.batch.query.device, on_gpu)
    for peer in peers:
        for label, make in p.runners(peer, case.batch, case.kv_cache, None, s.head_size**-0.5):
            if isinstance(make, str):
                yield label, None, None, make
                continue
            try:
                fn, out, _, note = make()
            except Exception as exc:  # a peer that cannot set up this shape is a row, not a crash
                yield label, None, None, f"error: {type(exc).__name__}: {str(exc)[:160]}"
                continue
            yield label, fn, out, note


# ---- phase 1: parallel compile in worker processes --------------------------------------------


def worker(task_file: str, result_file: str, dtype_name: str, tiny: bool) -> None:
    """Run each (shape, candidate) once, appending one result line each (flushed: a crash keeps them)."""
    import torch

    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = {s.name: s for s in (TINY_SHAPES if tiny else GPU_SHAPES)}
    cands = {c.name: c for c in candidates(tiny)}
    cases: dict[str, Case] = {}
    with open(task_file) as f:
        tasks = json.load(f)
    with open(result_file, "a") as res:
        for shape_name, cand_name in tasks:
            t0 = time.perf_counter()
            try:
                if shape_name not in cases:
                    cases[shape_name] = build_case(shapes[shape_name], dtype, device)
                fn, _, _ = candidate_fn(cases[shape_name], cands[cand_name])
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                status, note = "ok", ""
            except Exception as exc:
                status, note = "error", f"{type(exc).__name__}: {str(exc)[-300:]}"
                if device.type == "cuda":  # a device fault poisons the context: stop this worker
                    try:
                        torch.cuda.synchronize()
                    except Exception:
                        status = "crash"
            line = {"shape": shape_name, "candidate": cand_name, "status": status, "note": note,
                    "compile_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
            res.write(json.dumps(line) + "\n")
            res.flush()
            if status == "crash":
                return


def precompile(tasks: list[tuple[str, str]], args, env_root: str) -> dict[tuple[str, str], dict]:
    """Compile-and-run every task in `args.jobs` worker processes; returns task -> result line."""
    by_cand: dict[str, list[tuple[str, str]]] = {}
    for t in tasks:
        by_cand.setdefault(t[1], []).append(t)
    # Warp-specialized candidates get a worker each: a compiler hang there costs only its own runs.
    risky = [g for name, g in by_cand.items() if "-ws" in name]
    groups = [g for name, g in by_cand.items() if "-ws" not in name]
    n_chunks = max(1, min(len(groups), 2 * args.jobs - len(risky)))
    chunks = risky + [sum(groups[i::n_chunks], []) for i in range(n_chunks)]  # risky ones start first
    tmp = tempfile.mkdtemp(prefix="prefill_sweep_")
    env = dict(os.environ)
    env["PYTHONPATH"] = env_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")

    def run_chunk(i: int) -> list[dict]:
        task_file, result_file = os.path.join(tmp, f"tasks{i}.json"), os.path.join(tmp, f"results{i}.jsonl")
        with open(task_file, "w") as f:
            json.dump(chunks[i], f)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", task_file, "--result", result_file,
               "--dtype", args.dtype] + (["--tiny"] if args.tiny else [])  # fmt: skip
        try:
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=args.compile_timeout_s
            )
            tail = (proc.stderr or "")[-300:]
        except subprocess.TimeoutExpired:
            tail = f"worker timed out after {args.compile_timeout_s} s"
        lines = []
        if os.path.exists(result_file):
            with open(result_file) as f:
                lines = [json.loads(x) for x in f if x.strip()]
        done = {(x["shape"], x["candidate"]) for x in lines}
        for shape_name, cand_name in chunks[i]:
            if (shape_name, cand_name) not in done:
                lines.append({"shape": shape_name, "candidate": cand_name, "status": "crash",
                              "note": f"worker died before or during it: {tail}"})  # fmt: skip
        return lines

    results: dict[tuple[str, str], dict] = {}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for lines in pool.map(run_chunk, range(len(chunks))):
            for x in lines:
                results[(x["shape"], x["candidate"])] = x
    return results


# ---- phase 2: check and time ------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out-dir", default=".", help="where prefill_sweep.jsonl goes")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU: the Triton interpreter)")
    parser.add_argument("--quick", action="store_true", help="QUICK_SHAPES x QUICK_CANDIDATES only")
    parser.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float16; float32 on the CPU")
    parser.add_argument(
        "--peers", default="sdpa,fa4,flashinfer", help="library peers, each only if importable"
    )
    parser.add_argument("--only", default=None, help="comma list of substrings: candidates to keep")
    parser.add_argument("--shapes", default=None, help="comma list of substrings: shapes to keep")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compile workers")
    parser.add_argument("--no-precompile", action="store_true", help="compile in this process, one by one")
    parser.add_argument("--compile-timeout-s", type=int, default=60, help="per worker process")
    parser.add_argument("--rep-ms", type=int, default=40, help="do_bench timing window per kernel")
    parser.add_argument("--budget-s", type=float, default=215.0, help="stop timing new rows after this")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        if not args.tiny:
            parser.error("no CUDA GPU: only --tiny runs on the CPU (Triton interpreter)")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    if args.worker:
        worker(args.worker, args.result, args.dtype, args.tiny)
        return 0
    start = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda" if on_gpu else "cpu")
    shapes = [s for s in (TINY_SHAPES if args.tiny else GPU_SHAPES) if _keep(s.name, args.shapes)]
    cands = [c for c in candidates(args.tiny) if _keep(c.name, args.only)]
    if args.quick and not args.tiny:
        shapes = [s for s in shapes if s.name in QUICK_SHAPES]
        cands = [c for c in cands if c.name in QUICK_CANDIDATES]
    tasks = [(s.name, c.name) for s in shapes for c in cands if c.applies(s)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    compiled = {} if args.no_precompile or not on_gpu else precompile(tasks, args, root)
    print(f"phase 1: {len(tasks)} (shape, candidate) runs compiled in {time.perf_counter() - start:.0f} s "
          f"({sum(r['status'] != 'ok' for r in compiled.values())} failed)", flush=True)  # fmt: skip

    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "prefill_sweep.jsonl")
    rows: list[dict] = []
    with open(path, "w") as jsonl:
        env = {"kind": "env", "date": datetime.datetime.now(datetime.UTC).isoformat(), "argv": sys.argv,
               "device": torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu",
               "torch": torch.__version__, "triton": _version("triton"), "dtype": args.dtype,
               "compile_phase_s": round(time.perf_counter() - start, 1)}  # fmt: skip
        jsonl.write(json.dumps(env) + "\n")
        for line in compiled.values():  # phase 1: what compiled, how long each worker's run took
            jsonl.write(json.dumps({"kind": "compile", **line}) + "\n")
        for line in compiled.values():
            if line["status"] != "ok":
                print(
                    f"  compile {line['status']}: {line['shape']} / {line['candidate']}: {line['note'][:200]}"
                )
        for s in shapes:
            case = build_case(s, dtype, device)
            from kvllm.attention.reference import reference_attention

            b = case.batch
            case.ref = reference_attention(b.query, b.keys, b.values, b.query_lens, s.head_size**-0.5)
            runs = [(c.name, c.kind) for c in cands if c.applies(s)]
            peer_runs = list(peer_fns(case, [p for p in args.peers.split(",") if p], on_gpu))
            for name, kind in runs + [(label, "peer") for label, *_ in peer_runs]:
                row = {"kind": "row", "shape": s.name, "candidate": name, "type": kind}
                pre = compiled.get((s.name, name))
                if pre is not None and pre["status"] != "ok":
                    row.update(status=pre["status"], note=pre["note"])
                elif time.perf_counter() - start > args.budget_s:
                    row.update(status="skipped", note=f"time budget {args.budget_s:.0f} s spent")
                else:
                    if kind == "peer":
                        fn, out, note = next((f, o, n) for lbl, f, o, n in peer_runs if lbl == name)
                        row.update(_measure(case, fn, out, note, args, on_gpu))
                    else:
                        cand = next(c for c in cands if c.name == name)
                        row.update(_measure(case, *_safe_fn(case, cand), args, on_gpu))
                rows.append(row)
                jsonl.write(json.dumps(row) + "\n")
                jsonl.flush()
                print("  " + _fmt(row), flush=True)
            del case
            if on_gpu:
                torch.cuda.empty_cache()
    _summary(rows, shapes)
    print(f"wrote {path}; total {time.perf_counter() - start:.0f} s")
    return 0


def _safe_fn(case: Case, cand: Candidate):
    try:
        return candidate_fn(case, cand)
    except Exception as exc:
        return None, None, f"error: {type(exc).__name__}: {str(exc)[:200]}"


def _measure(case: Case, fn, out, note: str, args, on_gpu: bool) -> dict:

    s = case.shape
    if fn is None:
        return {"status": "skipped" if note.startswith("skipped") else "error", "note": note}
    try:
        out.fill_(float("nan"))
        fn()
        err = ((out.float() - case.ref).norm() / case.ref.norm()).item()
        if not err < TOLERANCE[args.dtype]:
            return {"status": "wrong", "rel_error": err, "note": note}
        if on_gpu:
            import triton.testing

            ms = triton.testing.do_bench(fn, warmup=10, rep=args.rep_ms, return_mode="median")
            graph_ms = None
            if s.decode:  # eager launches are host-bound at batch 1; the graph time is the kernels'
                try:
                    graph_ms = triton.testing.do_bench_cudagraph(fn, rep=args.rep_ms, return_mode="median")
                except Exception as exc:  # the eager time stands
                    note += f"; no graph time ({type(exc).__name__})"
        else:
            t0 = time.perf_counter()
            fn()
            ms, graph_ms = (time.perf_counter() - t0) * 1e3, None
    except Exception as exc:
        return {"status": "error", "note": f"{note}; {type(exc).__name__}: {str(exc)[:200]}"}
    flops = s.shape.flops(s.num_heads, s.head_size)
    kv_bytes = s.shape.kv_bytes(s.num_kv_heads, s.head_size, case.kv_cache.element_size())
    best = min(x for x in (ms, graph_ms) if x is not None)
    return {"status": "ok", "ms": ms, "graph_ms": graph_ms, "tflops": flops / (best * 1e-3) / 1e12,
            "tbps": kv_bytes / (best * 1e-3) / 1e12, "rel_error": err, "note": note}  # fmt: skip


def _fmt(row: dict) -> str:
    if row["status"] != "ok":
        return (
            f"{row['shape'][:34]:34} {row['candidate'][:44]:44} {row['status']}: {row.get('note', '')[:120]}"
        )
    graph = f" graph {row['graph_ms']:.4f} ms" if row.get("graph_ms") else ""
    return (f"{row['shape'][:34]:34} {row['candidate'][:44]:44} {row['ms']:.4f} ms{graph} "
            f"{row['tflops']:7.1f} TFLOP/s {row['tbps']:5.2f} TB/s err {row['rel_error']:.1e}  {row['note']}")  # fmt: skip


def _summary(rows: list[dict], shapes: list[SweepShape]) -> None:
    print("\nfastest per shape (decode: the CUDA-graph time where measured):")
    for s in shapes:
        ok = [r for r in rows if r["shape"] == s.name and r["status"] == "ok"]
        ours = [r for r in ok if r["type"] != "peer"]
        if not ours:
            print(f"  {s.name}: no candidate ran")
            continue
        best = max(ours, key=lambda r: r["tflops"])
        dflt = [
            r
            for r in ours
            if r["candidate"] in ("prefill default", "unified default", "decode default splits 64")
        ]
        peers = ", ".join(f"{r['candidate']} {r['tflops']:.0f} TFLOP/s {r['tbps']:.2f} TB/s" for r in ok
                          if r["type"] == "peer")  # fmt: skip
        line = f"  {s.name}: best {best['candidate']} {best['tflops']:.0f} TFLOP/s {best['tbps']:.2f} TB/s"
        line += "".join(f"; {r['candidate']} {r['tflops']:.0f} TFLOP/s" for r in dflt)
        if s.name == "qwen3 8x2048 causal":
            line += (
                f"; target >= {TARGET_TFLOPS:.0f}: {'met' if best['tflops'] >= TARGET_TFLOPS else 'NOT met'}"
            )
        print(line + (f"; peers: {peers}" if peers else ""))


def _keep(name: str, spec: str | None) -> bool:
    return spec is None or any(part and part in name for part in spec.split(","))


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:
        return "n/a"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
