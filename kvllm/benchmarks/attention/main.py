"""Kernel-level attention benchmark: our backends against torch SDPA, FlexAttention and FlashAttention-4.

Every kernel is first checked against the float32 reference on the same random paged batch; only
kernels that pass are timed (triton.testing.do_bench, median). Reported per shape and kernel: ms,
TFLOP/s (4 * H * D * visible (query, key) pairs; causal prefill = 4*B*H*S^2*D/2), TB/s of KV read
(K and V of every request read once) and the fractions of the measured copy bandwidth (a 2 GiB
device-to-device copy timed in the same run, bytes read + written) and of 790 TFLOP/s (H200 bf16).

Rows: TRITON_ATTN through its own ops (kernel tile sweeps with --sweep) and its KV write; then every
other registered backend valid here through its contract (builder.build + impl.forward, the forward
including the step's KV write; build() host time in the build column), see backends.py;
backends not valid here get a "skipped" row with their reasons. Then the peer (reference) kernels
of peers.py.

GPU (H200):   PYTHONPATH=. python -m kvllm.benchmarks.attention --output-json out.json
CPU (CI):     PYTHONPATH=. python -m kvllm.benchmarks.attention --tiny
The CPU run uses the Triton interpreter (TRITON_INTERPRET=1) on tiny shapes; GPU-only peers are
reported as skipped. Its times say nothing about GPU speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvllm.benchmarks.attention.peers import PEERS, Peers
from kvllm.benchmarks.attention.shapes import STANDARD_SHAPES, TINY_SHAPES, Shape, parse_shape

PEAK_TFLOPS = 790.0  # H200 dense bf16 matmul measured on this workplace's machine


@dataclass
class Row:
    shape: str
    kernel: str
    status: str  # ok, wrong, skipped, error
    ms: float | None = None
    tflops: float | None = None
    tbps: float | None = None
    frac_copy_bw: float | None = None
    frac_peak_flops: float | None = None
    rel_error: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)
    build_ms: float | None = None  # host time of the backend's metadata builder build() (backend rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tiny", action="store_true", help="tiny shapes; on a CPU-only machine runs the interpreter"
    )
    parser.add_argument("--shape", action="append", default=[], help="extra shape NAME:COUNTxQLEN@CTX[+...]")
    parser.add_argument("--only-shapes", action="store_true", help="run only the --shape ones")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma list from {PEERS}")
    parser.add_argument(
        "--backends",
        default=None,
        help="comma list of registered backends to give rows (default: all; 'none': peers only). "
        "TRITON_ATTN's rows are the triton and triton-kv-write peers: leaving it out drops them",
    )
    parser.add_argument(
        "--dtype", default=None, help="bfloat16 (GPU default), float16, float32 (CPU default)"
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="auto, fp8_e4m3, fp8_e5m2 (TRITON_ATTN only)"
    )
    parser.add_argument("--num-heads", type=int, default=None, help="16 (--tiny: 4)")
    parser.add_argument("--num-kv-heads", type=int, default=None, help="8 (--tiny: 2)")
    parser.add_argument("--head-size", type=int, default=None, help="128 (--tiny: 64)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rep-ms", type=int, default=200, help="do_bench timing window per kernel")
    parser.add_argument(
        "--timing",
        choices=["bench", "queued", "graph"],
        default="bench",
        help="bench: triton's do_bench, one call between events after an L2 flush (a call whose host "
        "launch outlasts the flush is timed with the host's gap in it); queued: calls enqueued back to "
        "back between one pair of events, the GPU's own rate while the host runs ahead of it (for shapes "
        "whose data is far beyond L2; the host's time per call is reported beside it); graph: the call "
        "captured once in a CUDA graph (as the engine runs decode steps) and its replays timed by do_bench, "
        "each after an L2 flush: the kernels' time with no host launch gap (a call that cannot be captured "
        "is timed as bench, and the row says so)",
    )
    parser.add_argument("--sweep", action="store_true", help="also time TRITON_ATTN tile configs")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    for name, full, tiny in (("num_heads", 16, 4), ("num_kv_heads", 8, 2), ("head_size", 128, 64)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)

    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        if not args.tiny:
            parser.error("no CUDA GPU: only --tiny runs on the CPU (Triton interpreter)")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    if not on_gpu and dtype == torch.bfloat16:
        parser.error("the Triton interpreter's bfloat16 tl.dot is broken: use float16 or float32 on the CPU")
    device = torch.device("cuda" if on_gpu else "cpu")
    shapes = [] if args.only_shapes else list(TINY_SHAPES if args.tiny else STANDARD_SHAPES)
    shapes += [parse_shape(s) for s in args.shape]
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    from kvllm.benchmarks.attention.backends import resolve_backend_names

    backends = resolve_backend_names(args.backends)
    if args.backends is not None and "TRITON_ATTN" not in backends:
        peers = [p for p in peers if p not in ("triton", "triton-kv-write")]

    bench = _Bench(args, dtype, device, on_gpu)
    rows: list[Row] = []
    copy_tbps = bench.copy_bandwidth()
    print(f"device copy bandwidth: {copy_tbps:.3f} TB/s (read + write)", flush=True)
    for shape in shapes:
        rows += bench.run_shape(shape, peers, copy_tbps, backends)
        # Written after every shape, so a run cut short by a time limit keeps what it measured.
        if args.output_json:
            report = {
                "date": datetime.datetime.now(datetime.UTC).isoformat(),
                "argv": sys.argv if argv is None else argv,
                "device": torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu",
                "versions": _versions(),
                "dtype": str(dtype),
                "timing": args.timing if on_gpu else "host clock",
                "copy_tbps": copy_tbps,
                "backends": backends,
                "rows": [asdict(r) for r in rows],
            }
            with open(args.output_json, "w") as f:
                json.dump(report, f, indent=2)
    _print_table(rows)
    return 0 if all(r.status in ("ok", "skipped") for r in rows) else 1


class _Bench:
    def __init__(self, args: argparse.Namespace, dtype, device, on_gpu: bool) -> None:
        self.args = args
        self.dtype = dtype
        self.device = device
        self.on_gpu = on_gpu
        self.peers = Peers(args, dtype, device, on_gpu)
        self.host_ms_per_call: list[float] = []  # queued timing: the host's enqueue time, last call last
        self.graph_notes: list[str] = []  # graph timing: how the row just timed ran (replayed, or why not)

    # ---- timing -----------------------------------------------------------------------------

    def time_ms(self, fn: Callable[[], object]) -> float:
        from kvllm.attention.ops.triton_unified_attention import is_interpreter

        if self.on_gpu and self.args.timing == "queued":
            return queued_ms(fn, self.args.rep_ms, self.host_ms_per_call)
        if self.on_gpu and self.args.timing == "graph":
            return graph_ms(fn, self._do_bench, capture_cuda_graph, self.graph_notes)
        if self.on_gpu:
            return self._do_bench(fn)
        fn()
        samples = []
        for _ in range(1 if is_interpreter() else 3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    def _do_bench(self, fn: Callable[[], object]) -> float:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=self.args.rep_ms, return_mode="median"))

    def copy_bandwidth(self) -> float:
        """The device's copy rate, the rows' yardstick: on a GPU one 2 GiB copy timed eagerly whatever
        --timing says (its launch is nothing beside it, and captured in a CUDA graph it ran at 2.77 TB/s
        against 4.27 eagerly on the H200, thirty-second session)."""
        import torch

        nbytes = 2 * 1024**3 if self.on_gpu else 64 * 1024**2
        buffers = torch.empty(2, nbytes, dtype=torch.uint8, device=self.device)

        def copy() -> None:
            buffers[1].copy_(buffers[0])

        ms = self._do_bench(copy) if self.on_gpu else self.time_ms(copy)
        return 2 * nbytes / (ms * 1e-3) / 1e12

    # ---- one shape --------------------------------------------------------------------------

    def sync(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()

    def run_shape(self, shape: Shape, peers: list[str], copy_tbps: float, backends: list[str]) -> list[Row]:
        import torch

        from kvllm.attention.reference import make_paged_batch
        from kvllm.attention.testing import dequantized
        from kvllm.utils.dtypes import FP8_TORCH_DTYPES

        a = self.args
        qlens, ctxs = shape.requests()
        print(f"[{shape.name}] building batch ({len(qlens)} requests, {sum(qlens)} query tokens)", flush=True)
        batch = make_paged_batch(qlens, ctxs, a.num_heads, a.num_kv_heads, a.head_size, a.block_size,
                                 dtype=self.dtype, device=self.device, seed=0)  # fmt: skip
        fp8 = FP8_TORCH_DTYPES.get(a.kv_cache_dtype)
        cache_dtype = fp8 or self.dtype
        from kvllm.attention.backends.triton_attn import TritonAttentionBackend

        # TRITON_ATTN's layout (KVLLM_TRITON_KV_LAYOUT): its pages' order in memory, for every peer.
        kv_cache = TritonAttentionBackend.allocate_kv_cache(batch.num_blocks, a.block_size, a.num_kv_heads,
                                                            a.head_size, self.dtype, self.device)  # fmt: skip
        batch.fill_cache(kv_cache[0], kv_cache[1])
        k_scale = torch.tensor(1.0, device=self.device)
        if fp8 is not None:
            kv_cache = kv_cache.to(fp8)
            keys = [dequantized(k, fp8, 1.0) for k in batch.keys]
            values = [dequantized(v, fp8, 1.0) for v in batch.values]
        else:
            keys, values = batch.keys, batch.values
        # The step's new K/V go into the cache once, with the Triton write kernel (checked by its own
        # tests), so every paged peer reads the same cache; the timed calls are attention only.
        from kvllm.attention.ops.triton_reshape_and_cache import reshape_and_cache

        reshape_and_cache(batch.new_keys, batch.new_values, kv_cache[0], kv_cache[1],
                          batch.metadata.slot_mapping, k_scale, k_scale)  # fmt: skip
        scale = a.head_size**-0.5
        from kvllm.attention.reference import reference_attention

        ref = reference_attention(batch.query, keys, values, batch.query_lens, scale)
        flops = shape.flops(a.num_heads, a.head_size)
        kv_bytes = shape.kv_bytes(
            a.num_kv_heads, a.head_size, torch.empty(0, dtype=cache_dtype).element_size()
        )
        tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}[self.dtype]

        rows = []
        ours = [p for p in peers if p.startswith("triton")]
        for peer in ours:
            self._peer_rows(rows, peer, shape, batch, kv_cache, k_scale, scale, ref, tol, flops, kv_bytes,
                            copy_tbps, cache_dtype)  # fmt: skip
        rows += self._backend_rows(shape, batch, backends, scale, ref, tol, flops, kv_bytes, copy_tbps,
                                   cache_dtype)  # fmt: skip
        for peer in peers:
            if peer not in ours:
                self._peer_rows(rows, peer, shape, batch, kv_cache, k_scale, scale, ref, tol, flops, kv_bytes,
                                copy_tbps, cache_dtype)  # fmt: skip
        return rows

    def _peer_rows(self, rows, peer, shape, batch, kv_cache, k_scale, scale, ref, tol, flops, kv_bytes,
                   copy_tbps, cache_dtype) -> None:  # fmt: skip
        for label, make in self.peers.runners(peer, batch, kv_cache, k_scale, scale):
            row = self._measure(shape, label, make, ref, tol, flops, kv_bytes, copy_tbps)
            if label == "TRITON_ATTN" and row.status == "ok":
                from kvllm.benchmarks.attention.backends import build_ms

                a = self.args
                try:
                    row.build_ms = build_ms("TRITON_ATTN", batch, cache_dtype, a.kv_cache_dtype, self.sync,
                                            self._build_budget_ms())  # fmt: skip
                except Exception as exc:  # the kernel row stands; say why its build time is missing
                    row.note += f"; build() not timed ({type(exc).__name__}: {str(exc)[:100]})"
            rows.append(row)
            print(f"  {_fmt_row(row)}", flush=True)

    def _build_budget_ms(self) -> float:
        return float(self.args.rep_ms) if self.on_gpu else 20.0

    def _backend_rows(self, shape, batch, backends, scale, ref, tol, flops, kv_bytes, copy_tbps,
                      cache_dtype) -> list[Row]:  # fmt: skip
        from kvllm.benchmarks.attention.backends import backend_results

        a = self.args
        rows: list[Row] = []

        def add(res) -> None:
            if res.status == "ok":
                row = self._ok_row(
                    shape,
                    res.kernel,
                    res.ms,
                    flops,
                    kv_bytes,
                    copy_tbps,
                    res.rel_error,
                    res.note + self._timing_note(),
                )
            else:
                row = Row(shape.name, res.kernel, res.status, rel_error=res.rel_error, note=res.note)
            row.build_ms, row.extra = res.build_ms, res.extra
            rows.append(row)
            print(f"  {_fmt_row(row)}", flush=True)

        backend_results(
            backends, batch, kv_cache_dtype=a.kv_cache_dtype, ref=ref, tol=tol, time_ms=self.time_ms,
            sync=self.sync, build_budget_ms=self._build_budget_ms(), on_result=add,
        )  # fmt: skip
        return rows

    def _measure(self, shape, label, make, ref, tol, flops, kv_bytes, copy_tbps) -> Row:
        if isinstance(make, str):
            return Row(shape.name, label, "skipped", note=make)
        try:
            fn, out, bytes_override, note = make()
            out.fill_(float("nan"))
            fn()
            err = None
            if ref is not None and bytes_override is None:
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if not err < tol:
                    return Row(
                        shape.name, label, "wrong", rel_error=err, note=f"tolerance {tol:g}; not timed"
                    )
            ms = self.time_ms(fn)
        except Exception as exc:  # a peer that cannot run this shape is a result, not a crash
            return Row(shape.name, label, "error", note=f"{type(exc).__name__}: {str(exc)[:200]}")
        nbytes = bytes_override if bytes_override is not None else kv_bytes
        return self._ok_row(shape, label, ms, 0.0 if bytes_override is not None else flops, nbytes, copy_tbps,
                            err, note + self._timing_note())  # fmt: skip

    def _timing_note(self) -> str:
        """Queued timing: the host's enqueue time per call for the row just timed; graph timing: whether
        it was replayed from a graph."""
        if self.graph_notes:
            note = self.graph_notes.pop()
            self.graph_notes.clear()
            return f"; {note}"
        if not self.host_ms_per_call:
            return ""
        host_ms = self.host_ms_per_call.pop()
        self.host_ms_per_call.clear()
        return f"; queued, host {host_ms:.3f} ms a call"

    @staticmethod
    def _ok_row(shape, label, ms, flops, nbytes, copy_tbps, err, note) -> Row:
        tbps = nbytes / (ms * 1e-3) / 1e12
        tflops = flops / (ms * 1e-3) / 1e12
        return Row(shape.name, label, "ok", ms=ms, tflops=tflops, tbps=tbps, frac_copy_bw=tbps / copy_tbps,
                   frac_peak_flops=tflops / PEAK_TFLOPS, rel_error=err, note=note)  # fmt: skip


def queued_ms(
    fn: Callable[[], object],
    window_ms: float,
    host_log: list[float],
    *,
    new_event: Callable[[], Any] | None = None,
    synchronize: Callable[[], None] | None = None,
    repeats: int = 5,
) -> float:
    """The GPU's milliseconds per call of `fn` with calls enqueued back to back between one pair of events
    (the median of `repeats` windows of about `window_ms`): while the host enqueues a call faster than the
    GPU runs one, the queue stays full and the host's launch time leaves the measure. Appends the host's
    milliseconds per call (enqueue time over the window) to `host_log`: when it is near the result, the
    call was host-bound and the number is the host's rate, not the kernels'."""
    if new_event is None or synchronize is None:
        import torch

        new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        synchronize = synchronize or torch.cuda.synchronize
    for _ in range(3):
        fn()
    synchronize()
    start, end = new_event(), new_event()
    start.record()
    fn()
    end.record()
    synchronize()
    calls = max(3, min(1000, int(window_ms / max(start.elapsed_time(end), 1e-3) / repeats)))
    per_call, host_per_call = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        host_per_call.append((time.perf_counter() - started) * 1e3 / calls)
        synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    host_log.append(statistics.median(host_per_call))
    return statistics.median(per_call)


def graph_ms(
    fn: Callable[[], object],
    time_call: Callable[[Callable[[], object]], float],
    capture: Callable[[Callable[[], object]], Callable[[], object]],
    notes: list[str],
) -> float:
    """`time_call`'s milliseconds for one replay of `fn` captured by `capture` (capture_cuda_graph): with
    do_bench, each replay after an L2 flush, and the host's launch work out of the measure, since one
    graph launch enqueues every kernel of the call. A call that cannot be captured (host syncs, a library
    that refuses capture) is timed as it is. Appends how it ran to `notes`."""
    try:
        replay = capture(fn)
    except Exception as exc:
        notes.append(f"not replayable ({type(exc).__name__}: {str(exc)[:80]}), timed as bench")
        return time_call(fn)
    notes.append("replayed from a CUDA graph")
    return time_call(replay)


def capture_cuda_graph(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` captured in a CUDA graph after three warm-up calls on a side stream (as torch's docs ask);
    returns the graph's replay (which holds the graph)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def _versions() -> dict[str, str]:
    import torch
    import triton

    versions = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    for name in ("flash_attn", "flashinfer"):
        try:
            versions[name] = getattr(__import__(name), "__version__", "?")
        except Exception:
            pass
    return versions


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _fmt_row(r: Row) -> str:
    return (
        f"{r.kernel:<34} {r.status:<7} {_fmt(r.ms, '.4f'):>9} ms {_fmt(r.tflops, '.1f'):>7} TFLOP/s "
        f"{_fmt(r.tbps, '.3f'):>7} TB/s {_fmt(r.frac_copy_bw, '.0%'):>5} copy {_fmt(r.frac_peak_flops, '.0%'):>5} peak "
        f"err {_fmt(r.rel_error, '.1e'):>7} build {_fmt(r.build_ms, '.3f'):>7} ms  {r.note}"
    )


def _print_table(rows: list[Row]) -> None:
    shape = None
    print()
    for r in rows:
        if r.shape != shape:
            shape = r.shape
            print(f"== {shape}")
        print("  " + _fmt_row(r))


if __name__ == "__main__":
    sys.exit(main())
