"""Kernel-level attention benchmark: our backends against torch SDPA, FlexAttention and FlashAttention-4.

Every kernel is first checked against the float32 reference on the same random paged batch; only
kernels that pass are timed (triton.testing.do_bench, median). Reported per shape and kernel: ms,
TFLOP/s (4 * H * D * visible (query, key) pairs; causal prefill = 4*B*H*S^2*D/2), TB/s of KV read
(K and V of every request read once) and the fractions of the measured copy bandwidth (a 2 GiB
device-to-device copy timed in the same run, bytes read + written) and of 790 TFLOP/s (H200 bf16).

Rows: TRITON_ATTN through its own ops (kernel tile sweeps with --sweep) and its KV write; then every
other registered backend valid here through its contract (builder.build + impl.forward, the forward
including the step's KV write; build() host time in the build column), see attention_backend_rows;
backends not valid here get a "skipped" row with their reasons. Then the peer (reference) kernels.

GPU (H200):   PYTHONPATH=. python -m kvllm.benchmarks.attention_kernels --output-json out.json
CPU (CI):     PYTHONPATH=. python -m kvllm.benchmarks.attention_kernels --tiny
The CPU run uses the Triton interpreter (TRITON_INTERPRET=1) on tiny shapes; GPU-only peers are
reported as skipped. Its times say nothing about GPU speed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

PEAK_TFLOPS = 790.0  # H200 dense bf16 matmul measured on this workplace's machine
PEERS = ("triton", "triton-kv-write", "sdpa", "flex", "fa4", "flashinfer")


@dataclass(frozen=True)
class Group:
    """`count` requests with `query_len` new tokens over `context_len` cached ones."""

    count: int
    query_len: int
    context_len: int


@dataclass(frozen=True)
class Shape:
    name: str
    groups: tuple[Group, ...]  # decode groups (query_len 1) must come first

    def requests(self) -> tuple[list[int], list[int]]:
        qs, cs = [], []
        for g in self.groups:
            qs += [g.query_len] * g.count
            cs += [g.context_len] * g.count
        return qs, cs

    def flops(self, num_heads: int, head_size: int) -> float:
        pairs = sum(g.count * (g.query_len * g.context_len + g.query_len**2 / 2) for g in self.groups)
        return 4.0 * num_heads * head_size * pairs

    def kv_bytes(self, num_kv_heads: int, head_size: int, itemsize: int) -> float:
        tokens = sum(g.count * (g.query_len + g.context_len) for g in self.groups)
        return 2.0 * tokens * num_kv_heads * head_size * itemsize


STANDARD_SHAPES = (
    Shape("decode b256 x ctx1k", (Group(256, 1, 1023),)),
    Shape("decode b1 x ctx32k", (Group(1, 1, 32767),)),
    Shape("decode b8 x ctx8k", (Group(8, 1, 8191),)),
    Shape("prefill 8x2048 causal", (Group(8, 2048, 0),)),
    Shape("mixed 16x512/1k + 240 dec", (Group(240, 1, 1023), Group(16, 512, 1024))),
)
TINY_SHAPES = (
    Shape("tiny decode b4 x ctx64", (Group(4, 1, 63),)),
    Shape("tiny prefill 2x48 causal", (Group(2, 48, 0),)),
    Shape("tiny mixed 2x16/32 + 3 dec", (Group(3, 1, 40), Group(2, 16, 32))),
)


def parse_shape(text: str) -> Shape:
    """`NAME:COUNTxQLEN@CTX[+COUNTxQLEN@CTX...]`, e.g. `long:4x1@65535` or `mix:30x1@2000+2x256@512`."""
    name, _, spec = text.rpartition(":")
    groups = []
    for part in spec.split("+"):
        count, _, rest = part.partition("x")
        qlen, _, ctx = rest.partition("@")
        groups.append(Group(int(count), int(qlen), int(ctx or 0)))
    groups.sort(key=lambda g: g.query_len != 1)
    return Shape(name or spec, tuple(groups))


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
    from kvllm.benchmarks.attention_backend_rows import resolve_backend_names

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

    # ---- timing -----------------------------------------------------------------------------

    def time_ms(self, fn: Callable[[], object]) -> float:
        from kvllm.attention.ops.triton_unified_attention import is_interpreter

        if self.on_gpu:
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=25, rep=self.args.rep_ms, return_mode="median"))
        fn()
        samples = []
        for _ in range(1 if is_interpreter() else 3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    def copy_bandwidth(self) -> float:
        import torch

        nbytes = 2 * 1024**3 if self.on_gpu else 64 * 1024**2
        buffers = torch.empty(2, nbytes, dtype=torch.uint8, device=self.device)
        ms = self.time_ms(lambda: buffers[1].copy_(buffers[0]))
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
        kv_cache = torch.zeros(2, batch.num_blocks, a.block_size, a.num_kv_heads, a.head_size,
                               dtype=self.dtype, device=self.device)  # fmt: skip
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
        for label, make in self._runners(peer, shape, batch, kv_cache, k_scale, scale):
            row = self._measure(shape, label, make, ref, tol, flops, kv_bytes, copy_tbps)
            if label == "TRITON_ATTN" and row.status == "ok":
                from kvllm.benchmarks.attention_backend_rows import build_ms

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
        from kvllm.benchmarks.attention_backend_rows import backend_results

        a = self.args
        rows: list[Row] = []

        def add(res) -> None:
            if res.status == "ok":
                row = self._ok_row(
                    shape, res.kernel, res.ms, flops, kv_bytes, copy_tbps, res.rel_error, res.note
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
                            err, note)  # fmt: skip

    @staticmethod
    def _ok_row(shape, label, ms, flops, nbytes, copy_tbps, err, note) -> Row:
        tbps = nbytes / (ms * 1e-3) / 1e12
        tflops = flops / (ms * 1e-3) / 1e12
        return Row(shape.name, label, "ok", ms=ms, tflops=tflops, tbps=tbps, frac_copy_bw=tbps / copy_tbps,
                   frac_peak_flops=tflops / PEAK_TFLOPS, rel_error=err, note=note)  # fmt: skip

    # ---- peers ------------------------------------------------------------------------------

    def _runners(self, peer, shape, batch, kv_cache, k_scale, scale) -> list[tuple[str, object]]:
        gpu_only = "skipped: GPU-only peer (no CUDA device)"
        if peer == "triton":
            out = [("TRITON_ATTN", lambda: self._triton(batch, kv_cache, k_scale, scale, None))]
            if self.args.sweep:
                for dec, pre in _sweep_configs(
                    batch.metadata.num_decodes > 0, batch.metadata.num_prefills > 0
                ):
                    label = f"TRITON_ATTN {_cfg_text(dec, pre)}"
                    out.append(
                        (label, lambda d=dec, p=pre: self._triton(batch, kv_cache, k_scale, scale, (d, p)))
                    )
            return out
        if peer == "triton-kv-write":
            return [("TRITON_ATTN kv-write", lambda: self._kv_write(batch, kv_cache, k_scale))]
        if peer == "sdpa":
            if self.args.kv_cache_dtype != "auto":
                return [("SDPA", "skipped: no fp8 KV cache")]
            return [("SDPA flash" if self.on_gpu else "SDPA (cpu default)", lambda: self._sdpa(batch, scale))]
        if peer == "flex":
            if not self.on_gpu:
                return [("FlexAttention", gpu_only)]
            if self.args.kv_cache_dtype != "auto":
                return [("FlexAttention", "skipped: no fp8 KV cache")]
            return [("FlexAttention compiled", lambda: self._flex(batch, scale))]
        if peer == "fa4":
            why_not = self._library_peer_skip("flash_attn.cute")
            if why_not:
                return [("FA4", why_not)]
            return [("FA4 paged varlen", lambda: self._fa4(batch, kv_cache, scale))]
        if peer == "flashinfer":
            why_not = self._library_peer_skip("flashinfer")
            if why_not:
                return [("FlashInfer", why_not)]
            return [("FlashInfer library", lambda: self._flashinfer(batch, kv_cache, scale))]
        raise SystemExit(f"unknown peer {peer!r} (known: {', '.join(PEERS)})")

    def _library_peer_skip(self, module: str) -> str | None:
        """Why a GPU library peer (16-bit cache only) cannot run here; None when it can."""
        if not self.on_gpu:
            return "skipped: GPU-only peer (no CUDA device)"
        try:
            importlib.import_module(module)
        except Exception as exc:
            return f"skipped: {module} not importable ({type(exc).__name__})"
        if self.args.kv_cache_dtype != "auto":
            return "skipped: fp8 KV cache not set up here"
        return None

    def _triton(self, batch, kv_cache, k_scale, scale, configs):
        import torch

        from kvllm.attention.backends.triton_attn import TritonAttentionBackend
        from kvllm.attention.backends.triton_attn_impl import TritonAttentionMetadataBuilder
        from kvllm.attention.metadata import KVCacheSpec
        from kvllm.attention.ops.triton_unified_attention import unified_attention

        a, md = self.args, batch.metadata
        spec = KVCacheSpec(a.block_size, a.num_kv_heads, a.head_size, kv_cache.dtype, a.kv_cache_dtype)
        builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, self.device, md.num_reqs,
                                                 md.num_actual_tokens, md.max_seq_len + a.block_size)  # fmt: skip
        tm = builder.build(md)
        out = torch.empty_like(batch.query)
        dec, pre = configs or (None, None)

        def fn():
            unified_attention(
                out, batch.query, kv_cache[0], kv_cache[1], tm.query_start_loc, tm.seq_lens, tm.block_table,
                num_reqs=tm.num_reqs, num_tokens=tm.num_actual_tokens, num_decode_reqs=tm.num_decode_reqs,
                scale=scale, k_scale=k_scale, v_scale=k_scale, num_splits=tm.num_splits,
                decode_cfg=dec, prefill_cfg=pre,
            )  # fmt: skip

        return fn, out, None, f"splits={tm.num_splits}"

    def _kv_write(self, batch, kv_cache, k_scale):
        from kvllm.attention.ops.triton_reshape_and_cache import reshape_and_cache

        md = batch.metadata

        def fn():
            reshape_and_cache(batch.new_keys, batch.new_values, kv_cache[0], kv_cache[1], md.slot_mapping,
                              k_scale, k_scale)  # fmt: skip

        moved = 2 * batch.new_keys.numel() * (batch.new_keys.element_size() + kv_cache.element_size())
        return fn, batch.new_keys.new_empty(0), moved, "TB/s = K/V bytes read + written"

    def _sdpa(self, batch, scale):
        import contextlib

        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        group = self.args.num_heads // self.args.num_kv_heads
        # Contiguous per-sequence inputs, K/V repeated to the query heads, requests of one group batched.
        calls = []
        start = req = 0
        out = torch.empty_like(batch.query)
        qlens = batch.query_lens
        while req < len(qlens):
            end = req
            while (
                end < len(qlens) and qlens[end] == qlens[req] and batch.seq_lens[end] == batch.seq_lens[req]
            ):
                end += 1
            qlen, seq = qlens[req], batch.seq_lens[req]
            n = end - req
            q = batch.query[start : start + n * qlen].view(n, qlen, *batch.query.shape[1:]).transpose(1, 2)
            k = torch.stack(batch.keys[req:end]).repeat_interleave(group, dim=2).transpose(1, 2).contiguous()
            v = (
                torch.stack(batch.values[req:end])
                .repeat_interleave(group, dim=2)
                .transpose(1, 2)
                .contiguous()
            )
            q = q.contiguous()
            mask = causal_lower_right(qlen, seq) if qlen > 1 and seq > qlen else None
            calls.append((q, k, v, mask, qlen > 1 and seq == qlen, out[start : start + n * qlen], n, qlen))
            start += n * qlen
            req = end
        ctx = (lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)) if self.on_gpu else contextlib.nullcontext

        def fn():
            with ctx():
                for q, k, v, mask, causal, dst, n, qlen in calls:
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
                    dst.copy_(o.transpose(1, 2).reshape(n * qlen, *o.shape[1:2], o.shape[-1]))

        return fn, out, None, "contiguous, K/V repeated to query heads"

    def _flex(self, batch, scale):
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        dev = self.device
        q = batch.query.transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, Tq, D]
        k = torch.cat(batch.keys).transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hkv, Tk, D]
        v = torch.cat(batch.values).transpose(0, 1).unsqueeze(0).contiguous()
        q_doc = torch.repeat_interleave(torch.arange(len(batch.query_lens), device=dev),
                                        torch.tensor(batch.query_lens, device=dev))  # fmt: skip
        k_doc = torch.repeat_interleave(torch.arange(len(batch.seq_lens), device=dev),
                                        torch.tensor(batch.seq_lens, device=dev))  # fmt: skip
        q_off = torch.cat(
            [torch.arange(s - ql, s, device=dev) for ql, s in zip(batch.query_lens, batch.seq_lens)]
        )
        k_off = torch.cat([torch.arange(s, device=dev) for s in batch.seq_lens])

        def mask_mod(b, h, qi, ki):
            return (q_doc[qi] == k_doc[ki]) & (k_off[ki] <= q_off[qi])

        block_mask = create_block_mask(mask_mod, 1, 1, q.shape[2], k.shape[2], device=dev)
        compiled = torch.compile(flex_attention, dynamic=False)
        out = torch.empty_like(batch.query)

        def fn():
            o = compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
            out.copy_(o[0].transpose(0, 1))

        return fn, out, None, "block mask over the logical (contiguous) layout"

    def _fa4(self, batch, kv_cache, scale):
        import torch
        from flash_attn.cute import flash_attn_varlen_func

        md = batch.metadata
        out = torch.empty_like(batch.query)

        def fn():
            res = flash_attn_varlen_func(
                batch.query, kv_cache[0], kv_cache[1], cu_seqlens_q=md.query_start_loc, seqused_k=md.seq_lens,
                max_seqlen_q=md.max_query_len, page_table=md.block_table, causal=True, softmax_scale=scale,
            )  # fmt: skip
            out.copy_(res[0] if isinstance(res, tuple) else res)

        return fn, out, None, "page_table over the same cache"

    def _flashinfer(self, batch, kv_cache, scale):
        """The library alone: its wrappers planned once outside the timing, then run() per call."""
        import flashinfer
        import torch

        md = batch.metadata
        a = self.args
        fi_cache = kv_cache.transpose(0, 1).contiguous()  # FlashInfer's NHD (num_blocks, 2, bs, Hkv, D)
        seq_lens = md.seq_lens.tolist()
        table = md.block_table.tolist()
        pages = [table[r][: (n + a.block_size - 1) // a.block_size] for r, n in enumerate(seq_lens)]

        def page_lists(reqs):
            indptr = [0]
            for r in reqs:
                indptr.append(indptr[-1] + len(pages[r]))
            indices = [p for r in reqs for p in pages[r]]
            last = [(seq_lens[r] - 1) % a.block_size + 1 for r in reqs]
            as_int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=self.device)  # noqa: E731
            return as_int32(indptr), as_int32(indices), as_int32(last)

        num_decodes, num_reqs = md.num_decodes, len(seq_lens)
        qsl = md.query_start_loc.tolist()
        heads = dict(num_qo_heads=a.num_heads, num_kv_heads=a.num_kv_heads, page_size=a.block_size,
                     q_data_type=self.dtype, kv_data_type=kv_cache.dtype, sm_scale=scale)  # fmt: skip
        runs = []
        if num_decodes:
            ws = torch.zeros(128 << 20, dtype=torch.uint8, device=self.device)
            decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
            decode.plan(*page_lists(range(num_decodes)), head_dim=a.head_size, **heads)
            runs.append((decode, 0, qsl[num_decodes]))
        if num_decodes < num_reqs:
            ws = torch.zeros(128 << 20, dtype=torch.uint8, device=self.device)
            prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            qo_indptr = torch.tensor([q - qsl[num_decodes] for q in qsl[num_decodes:]], dtype=torch.int32,
                                     device=self.device)  # fmt: skip
            prefill.plan(qo_indptr, *page_lists(range(num_decodes, num_reqs)), head_dim_qk=a.head_size,
                         causal=True, **heads)  # fmt: skip
            runs.append((prefill, qsl[num_decodes], qsl[-1]))
        out = torch.empty_like(batch.query)

        def fn():
            for wrapper, start, end in runs:
                wrapper.run(batch.query[start:end], fi_cache, out=out[start:end])

        return fn, out, None, "decode + prefill wrappers, planned once (not timed)"


def _sweep_configs(has_decodes: bool, has_prefills: bool):
    from kvllm.attention.ops.triton_unified_attention import KernelConfig

    if has_decodes and not has_prefills:
        for tile_n in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    yield KernelConfig(16, tile_n, warps, stages), None
    if has_prefills and not has_decodes:
        for block_m in (64, 128):
            for tile_n in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3):
                        yield None, KernelConfig(block_m, tile_n, warps, stages)


def _cfg_text(dec, pre) -> str:
    cfg = dec or pre
    kind = "dec" if dec else "pre"
    return f"{kind} M{cfg.block_m} N{cfg.tile_n} w{cfg.num_warps} s{cfg.num_stages}"


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
