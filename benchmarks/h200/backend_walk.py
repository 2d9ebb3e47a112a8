"""Conformance walks of FLASHINFER and FLASH_ATTN on a GPU: every case against the float32 reference.

Each case is one (dtype, KV dtype, head size, block size, feature) combination run through the
backend's builder and implementation on a mixed batch (tests/gpu/test_*_gpu.py `run_case`), and
gives one JSON line: pass / fail (with the relative max error and the tolerance) / error / not_run.
Cases are the backend's declared combinations plus, for FLASHINFER, what its kernel side implements
beyond them (`widen_cases`); probes add what the declarations cannot express yet (FlashInfer 0.5.3's
sink-capable kernels on SM 9.0, FA4's fp8 KV, which FlashAttention builds load beside torch).

    python benchmarks/h200/backend_walk.py flashinfer --out DIR --shard 0/5 --deadline-s 200
    python benchmarks/h200/backend_walk.py flashinfer_probes --out DIR --deadline-s 200
    python benchmarks/h200/backend_walk.py flash_attn --out DIR --deadline-s 120
    python benchmarks/h200/backend_walk.py summary DIR      # walk-summary.json + the declaration lines

FlashInfer compiles one module per (dtype, KV dtype, head size, feature) on first use (one to two
minutes each), so FLASHINFER cases are ordered by how much a passing group widens the declaration
and sharded by compile group: shard i of n takes groups i, i+n, ... Results are also kept in
$KVLLM_WALK_STATE (default /tmp/kvllm-walk) so a rerun on the same warm machine skips what already
ran and continues; $KVLLM_WALK_DONE names folders of earlier leases' results to skip as well.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvllm.attention.backends.flashinfer import cache_dtype_name  # noqa: E402

STATE = Path(os.environ.get("KVLLM_WALK_STATE", "/tmp/kvllm-walk"))
# FLASHINFER compile groups in the order they widen the declaration most per minute of compiling.
HEAD_FEATURE_ORDER = [(128, "none"), (64, "none"), (256, "none"), (128, "window"), (128, "softcap"),
                      (64, "window"), (64, "softcap"), (256, "window"), (256, "softcap")]  # fmt: skip
DTYPE_ORDER = ["bfloat16", "float16"]


def _group_rank(case: tuple) -> int:
    """The case's FlashInfer compile group, as a rank: bf16 before fp16, model-dtype caches before
    fp8 (fp8 and fp8_e4m3 compile the same module), then HEAD_FEATURE_ORDER."""
    dtype, kv, head, _block, feature = case
    kv_group = 2 if kv == "fp8_e5m2" else int(kv.startswith("fp8"))
    hf = HEAD_FEATURE_ORDER.index((head, feature)) if (head, feature) in HEAD_FEATURE_ORDER else 99
    return (DTYPE_ORDER.index(dtype) * 3 + kv_group) * 100 + hf


def _record(out: Path, row: dict) -> None:
    line = json.dumps(row, sort_keys=True)
    for path in (out, STATE / out.name):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(line + "\n")
    print(line, flush=True)


def _already_run(name: str) -> dict[tuple, dict]:
    """Cases that passed or failed in an earlier run, by `_identity` (a bfloat16 model's `auto` and
    `bfloat16` caches are one case): this machine's state file of the same name, and every walk-*.jsonl in
    the folders of $KVLLM_WALK_DONE (colon-separated: committed results of earlier leases, so a fresh
    machine does not compile again what already passed)."""
    paths = [STATE / name]
    for folder in filter(None, os.environ.get("KVLLM_WALK_DONE", "").split(":")):
        paths += sorted(Path(folder).glob("walk-*.jsonl"))
    done = {}
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("status") in ("pass", "fail") and "case" in row:
                done[_identity(row)] = row
    return done


def walk_cases(backend: str, cases: list[tuple], declared: set, run_case, tolerance: dict, out: Path,
               deadline: float) -> None:  # fmt: skip
    import torch

    done = _already_run(out.name)
    for case in cases:
        dtype, kv, head, block, feature = case
        key = f"{backend}/{dtype}/{kv}/{head}/{block}/{feature}"
        row = {"backend": backend, "case": key, "dtype": dtype, "kv_cache_dtype": kv, "head_size": head,
               "block_size": block, "feature": feature, "declared": case in declared}  # fmt: skip
        earlier = done.get(_identity(row))
        if earlier is not None:
            _record(out, {**earlier, **row, "from_earlier_run": True, "ran_as": earlier["case"]})
            continue
        if time.monotonic() > deadline:
            _record(out, {**row, "status": "not_run", "error": "deadline reached"})
            continue
        start = time.monotonic()
        tol = tolerance[getattr(torch, dtype)]
        try:
            err = run_case(getattr(torch, dtype), kv, head, block, feature)
            result = {**row, "status": "pass" if err < tol else "fail", "rel_max_error": err, "tolerance": tol,
                      "seconds": round(time.monotonic() - start, 2)}  # fmt: skip
            done[_identity(row)] = result
            _record(out, result)
        except Exception as exc:  # a case that crashes is a result
            _record(out, {**row, "status": "error", "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                          "seconds": round(time.monotonic() - start, 2)})  # fmt: skip


def run_flashinfer(args: argparse.Namespace) -> None:
    from tests.gpu import test_flashinfer_gpu as t

    declared = set(t.declared_cases())
    cases = sorted(set(declared) | set(t.widen_cases()), key=lambda c: (_group_rank(c), c[3]))
    index, count = (int(x) for x in args.shard.split("/"))
    groups = sorted({_group_rank(c) for c in cases})
    mine = {g for i, g in enumerate(groups) if i % count == index}
    deadline = time.monotonic() + args.deadline_s
    out = Path(args.out) / f"walk-flashinfer-{index}of{count}.jsonl"
    walk_cases("FLASHINFER", [c for c in cases if _group_rank(c) in mine], declared, t.run_case, t.TOLERANCE,
               out, deadline)  # fmt: skip


def run_flashinfer_probes(args: argparse.Namespace) -> None:
    from walk_probes import flashinfer_sink_probes

    out = Path(args.out) / "walk-flashinfer-probes.jsonl"
    for row in flashinfer_sink_probes(time.monotonic() + args.deadline_s):
        _record(out, row)


def run_flash_attn(args: argparse.Namespace) -> None:
    from walk_probes import flash_attn_probes

    from tests.gpu import test_flash_attn_gpu as t

    out = Path(args.out) / "walk-flash_attn.jsonl"
    deadline = time.monotonic() + args.deadline_s
    for row in flash_attn_probes():
        _record(out, row)
    # bf16, model-dtype caches and 16-token pages first: every head size and feature early in the walk.
    declared = sorted(t.declared_cases(), key=lambda c: (c[0] != "bfloat16", c[1] != "auto", c[3] != 16, c))
    run_case = lambda dtype, _kv, head, block, feature: t.run_case(dtype, head, block, feature)  # noqa: E731
    walk_cases("FLASH_ATTN", declared, set(declared), run_case, t.TOLERANCE, out, deadline)


def expected_flashinfer_cases() -> list[tuple]:
    """Every case a full FLASHINFER walk runs (declared and widening), or [] where the tests can't load."""
    try:
        from tests.gpu import test_flashinfer_gpu as t
    except Exception:  # noqa: BLE001 - a summary without torch or the tests still summarizes what ran
        return []
    return sorted(set(t.declared_cases()) | set(t.widen_cases()))


def _missing_rows(backend: str, expected: list[tuple], cases: list[dict]) -> list[dict]:
    """A walk stopped from outside (a call's time limit) leaves no not_run lines: its missing cases. A case
    counts as run when one of the same cache dtype did (`auto` and the model's dtype, `fp8` and `fp8_e4m3`
    build one module and run the same kernels)."""
    seen = {_identity(r) for r in cases}
    rows = []
    for dtype, kv, head, block, feature in expected:
        row = {"backend": backend, "case": f"{backend}/{dtype}/{kv}/{head}/{block}/{feature}", "dtype": dtype,
               "kv_cache_dtype": kv, "head_size": head, "block_size": block, "feature": feature}  # fmt: skip
        if _identity(row) not in seen:
            rows.append(
                {**row, "declared": False, "status": "not_run", "error": "no result: the walk stopped"}
            )
    return rows


def _identity(row: dict) -> tuple:
    return (*cache_pair(row), row["head_size"], row["block_size"], row["feature"])


def _axes(rows: list[dict]) -> dict:
    axes = {}
    for axis in ("head_size", "block_size", "feature", "kv_cache_dtype", "dtype"):
        axes[axis] = {}
        for value in sorted({r[axis] for r in rows}, key=str):
            group = [r for r in rows if r[axis] == value]
            counts = {s: sum(r["status"] == s for r in group) for s in ("pass", "fail", "error", "not_run")}
            axes[axis][str(value)] = {**counts, "cases": len(group), "all_passed": counts["pass"] == len(group),
                                      "declared": all(r["declared"] for r in group)}  # fmt: skip
    return axes


def cache_pair(row: dict) -> tuple[str, str]:
    """(model dtype, cache dtype) as FlashInferBackend.VERIFIED_BY_DTYPES keys them."""
    return row["dtype"], cache_dtype_name(row["dtype"], row["kv_cache_dtype"])


def summarize(directory: Path, expected: dict[str, list[tuple]] | None = None) -> dict:
    """Per backend and axis value: cases passed / failed / not run, and whether it may be declared.
    `expected`: per backend, the cases a full walk runs; those without a line count as not run."""
    rows = [
        json.loads(line)
        for p in sorted(directory.glob("walk-*.jsonl"))
        for line in p.read_text().splitlines()
    ]
    cases = [r for r in rows if "case" in r]
    summary: dict = {"probes": [r for r in rows if "probe" in r], "backends": {}}
    expected = expected or {}
    for backend in sorted({r["backend"] for r in cases}):
        mine = [r for r in cases if r["backend"] == backend]
        mine += _missing_rows(backend, expected.get(backend, []), mine)
        axes = _axes(mine)
        failures = [r for r in mine if r["status"] in ("fail", "error")][:20]
        summary["backends"][backend] = {"axes": axes, "first_failures": failures,
                                        "declare": _declaration_lines(backend, axes)}  # fmt: skip
        if backend == "FLASHINFER":
            pairs = sorted({cache_pair(r) for r in mine})
            summary["backends"][backend]["declare_by_dtypes"] = [
                _pair_line(pair, _axes([r for r in mine if cache_pair(r) == pair])) for pair in pairs
            ]
    return summary


def _passed(axes: dict) -> dict[str, list[str]]:
    return {a: [v for v, c in values.items() if c["all_passed"]] for a, values in axes.items()}


def _declaration_lines(backend: str, axes: dict) -> list[str]:
    """The FLASHINFER lines to apply: every value whose whole slice of the walk passed."""
    if backend != "FLASHINFER":
        return []
    passed = _passed(axes)
    feature = passed["feature"]
    sizes = lambda axis: repr(tuple(sorted(int(v) for v in passed[axis])))  # noqa: E731
    return [
        f"VERIFIED_HEAD_SIZES = {sizes('head_size')}",
        f"VERIFIED_BLOCK_SIZES = {sizes('block_size')}",
        f"VERIFIED_SLIDING_WINDOW = {'window' in feature}",
        f"VERIFIED_LOGITS_SOFT_CAP = {'softcap' in feature}",
    ]


def _pair_line(pair: tuple[str, str], axes: dict) -> str:
    """One VERIFIED_BY_DTYPES entry: what passed completely for one (model dtype, cache dtype) pair."""
    passed = _passed(axes)
    sizes = lambda axis: tuple(sorted(int(v) for v in passed[axis]))  # noqa: E731
    feature = passed["feature"]
    return (f"{pair!r}: VerifiedAxes({sizes('head_size')!r}, {sizes('block_size')!r}, {'window' in feature}, "
            f"{'softcap' in feature}),")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("flashinfer", "flashinfer_probes", "flash_attn", "summary"))
    parser.add_argument("dir", nargs="?", help="summary: the folder of walk-*.jsonl files")
    parser.add_argument("--out", default=os.environ.get("OUT", "walk-out"))
    parser.add_argument("--shard", default="0/1", help="i/n: this process's share of the compile groups")
    parser.add_argument(
        "--deadline-s", type=float, default=200.0, help="start no case after this many seconds"
    )
    args = parser.parse_args(argv)
    if args.what == "summary":
        directory = Path(args.dir or args.out)
        summary = summarize(directory, {"FLASHINFER": expected_flashinfer_cases()})
        (directory / "walk-summary.json").write_text(json.dumps(summary, indent=1))
        for backend, data in summary["backends"].items():
            print(backend)
            for axis, values in data["axes"].items():
                text = ", ".join(f"{v}: {c['pass']}/{c['cases']}" for v, c in values.items())
                print(f"  {axis}: {text}")
            for line in data["declare"]:
                print(f"  declare: {line}")
            for line in data.get("declare_by_dtypes", []):
                print(f"  declare for VERIFIED_BY_DTYPES: {line}")
        for probe in summary["probes"]:
            print(f"probe {probe['probe']}: {probe['status']} {probe.get('detail', '')}")
        return 0
    os.environ.setdefault("KVLLM_GPU_TEST_DEVICE", "cuda")
    runs = {
        "flashinfer": run_flashinfer,
        "flashinfer_probes": run_flashinfer_probes,
        "flash_attn": run_flash_attn,
    }
    runs[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
