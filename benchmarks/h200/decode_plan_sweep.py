"""TRITON_ATTN's decode launch on ragged batches like nano-vllm's tail, timed as the engine replays it
(inside a CUDA graph), over tiles x split counts x launch order; writes the KVLLM_TRITON_DECODE_PLAN
that takes each batch size's fastest.

    PYTHONPATH=. python3 benchmarks/h200/decode_plan_sweep.py --out /tmp/sweep.json --plan-out /tmp/plan.txt

Qwen3-0.6B's attention (16 query heads, 8 KV heads, head size 128, bf16, 16-token pages). Each batch
size gets contexts drawn from [--ctx-lo, --ctx-hi] (seeded; in draw order, as a serving batch is).
Each candidate is checked against the float32 reference first, then timed: one CUDA graph of as many
calls as there are KV-cache copies (each call reads another copy, so the L2 cache holds none of it),
replayed; ms per call is the median replay over the calls. The default row is the engine's own
choice for a graph of that size (default tiles, split policy for max_model_len --max-model-len,
longest first when unsplit).

A batch size's plan entry is its fastest candidate when that beats the default by more than
--margin, else the default's own settings (so that a smaller entry never covers a larger batch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from benchmarks.h200.graph_timing import graph_call_ms
from kvllm.attention.backends.triton_attn import TritonAttentionBackend
from kvllm.attention.backends.triton_attn_impl import TritonAttentionMetadataBuilder
from kvllm.attention.metadata import KVCacheSpec
from kvllm.attention.ops.triton_reshape_and_cache import reshape_and_cache
from kvllm.attention.ops.triton_unified_attention import KernelConfig, decode_config, unified_attention
from kvllm.attention.reference import make_paged_batch, reference_attention
from kvllm.benchmarks.attention.shapes import Group

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 16, 8, 128, 16
KV_BYTES_PER_TOKEN = 2 * KV_HEADS * HEAD_SIZE * 2  # K and V, bf16


def candidates(args: argparse.Namespace):
    """(tile_n, warps, stages, splits, ordered) to time."""
    for tile_n in args.tiles:
        for warps in args.warps:
            for stages in args.stages:
                for splits in args.splits:
                    for ordered in (True, False) if splits > 1 else (True,):
                        yield tile_n, warps, stages, splits, ordered


def graph_ms(calls, repeats: int = 7) -> float:
    """Median ms per call of one CUDA graph holding `calls`, after a warm-up replay (on the CPU, where the
    Triton interpreter runs the kernels for a smoke test: the calls timed eagerly, once)."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) * 1e3 / len(calls)
    return graph_call_ms(lambda i: calls[i](), len(calls), repeats, warmups=len(calls))


def sweep_batch(args: argparse.Namespace, num_reqs: int) -> dict:
    contexts = Group(num_reqs, 1, args.ctx_lo, args.ctx_hi).contexts()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's dots take fp16
    batch = make_paged_batch([1] * num_reqs, contexts, HEADS, KV_HEADS, HEAD_SIZE, BLOCK, dtype=dtype,
                             device=device, seed=num_reqs)  # fmt: skip
    kv_bytes = sum(c + 1 for c in contexts) * KV_BYTES_PER_TOKEN
    copies = max(1, min(8, -(-args.l2_flush_bytes // kv_bytes)))
    caches = []
    one = torch.tensor(1.0, device=device)
    for _ in range(copies):
        cache = TritonAttentionBackend.allocate_kv_cache(batch.num_blocks, BLOCK, KV_HEADS, HEAD_SIZE, dtype,
                                                         device)  # fmt: skip
        batch.fill_cache(cache[0], cache[1])
        reshape_and_cache(batch.new_keys, batch.new_values, cache[0], cache[1], batch.metadata.slot_mapping,
                          one, one)  # fmt: skip
        caches.append(cache)
    scale = HEAD_SIZE**-0.5
    ref = reference_attention(batch.query, batch.keys, batch.values, batch.query_lens, scale)
    spec = KVCacheSpec(BLOCK, KV_HEADS, HEAD_SIZE, dtype, "auto")
    builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, torch.device(device), num_reqs, num_reqs,
                                             args.max_model_len)  # fmt: skip
    md = batch.metadata
    order = torch.sort(md.seq_lens, descending=True).indices
    default_splits = builder.num_splits_for(num_reqs, args.max_model_len)
    default_ordered = builder.orders_decodes(num_reqs, default_splits)
    base = decode_config(HEAD_SIZE, HEADS // KV_HEADS, dtype)
    default = (base.tile_n, base.num_warps, base.num_stages, default_splits, default_ordered)
    outs = [torch.empty_like(batch.query) for _ in caches]

    def calls_for(cand):
        tile_n, warps, stages, splits, ordered = cand
        cfg = KernelConfig(base.block_m, tile_n, warps, stages)

        def call(i):
            unified_attention(
                outs[i], batch.query, caches[i][0], caches[i][1], md.query_start_loc, md.seq_lens, md.block_table,
                num_reqs=num_reqs, num_tokens=num_reqs, num_decode_reqs=num_reqs, scale=scale, num_splits=splits,
                decode_order=order if ordered else None, decode_cfg=cfg,
            )  # fmt: skip

        return [lambda i=i: call(i) for i in range(len(caches))]

    rows = []
    todo = [default] + [c for c in candidates(args) if c != default]
    for cand in todo:
        row = {"tile_n": cand[0], "warps": cand[1], "stages": cand[2], "splits": cand[3], "ordered": cand[4],
               "default": cand == default}  # fmt: skip
        try:
            calls = calls_for(cand)
            outs[0].fill_(float("nan"))
            calls[0]()
            err = ((outs[0].float() - ref).norm() / ref.norm()).item()
            if not err < 1.5e-2:
                row["error"] = f"relative error {err:.2e} against the float32 reference"
            else:
                ms = graph_ms(calls)
                row.update(ms=round(ms, 5), tb_per_s=round(kv_bytes / (ms * 1e-3) / 1e12, 3), rel_err=err)
        except Exception as exc:  # out of shared memory / registers for this tile: not a candidate here
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            torch.cuda.synchronize()
        rows.append(row)
    timed = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    default_row = rows[0]
    best = timed[0]
    print(f"[b{num_reqs}] {kv_bytes / 1e6:.0f} MB of KV, {copies} copies; default "
          f"{_text(default_row)}: {default_row.get('ms', 'failed')} ms")  # fmt: skip
    for r in timed[:6]:
        print(f"    {_text(r):28s} {r['ms']:.4f} ms {r['tb_per_s']:.2f} TB/s"
              f"{'  (default)' if r['default'] else ''}")  # fmt: skip
    return {"num_reqs": num_reqs, "kv_bytes": kv_bytes, "copies": copies, "default": default_row, "best": best,
            "rows": rows}  # fmt: skip


def _text(r: dict) -> str:
    return f"N{r['tile_n']} w{r['warps']} s{r['stages']} x{r['splits']}{' o' if r['ordered'] else ''}"


def plan_entry(result: dict, margin: float) -> str:
    default, best = result["default"], result["best"]
    use = best if "ms" not in default or best["ms"] < default["ms"] * (1 - margin) else default
    order = ",o" if use["ordered"] and use["splits"] > 1 else ""
    return f"{result['num_reqs']}:{use['tile_n']},{use['warps']},{use['stages']},{use['splits']}{order}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="8,16,24,32,48,64,96,128,192,256")
    parser.add_argument("--splits", default="1,2,4,8")
    parser.add_argument("--tiles", default="32,64,128")
    parser.add_argument("--warps", default="2,4")
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--ctx-lo", type=int, default=100)
    parser.add_argument("--ctx-hi", type=int, default=2047)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--l2-flush-bytes", type=int, default=512 * 1024**2)
    parser.add_argument("--margin", type=float, default=0.03)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plan-out", required=True)
    args = parser.parse_args(argv)
    for name in ("splits", "tiles", "warps", "stages"):
        setattr(args, name, [int(x) for x in getattr(args, name).split(",")])
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        print(
            "decode_plan_sweep: needs a CUDA device (or TRITON_INTERPRET=1 for a CPU smoke run)",
            file=sys.stderr,
        )
        return 2
    results = []
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    plan = ""
    for num_reqs in sorted(int(b) for b in args.batches.split(",")):
        results.append(sweep_batch(args, num_reqs))
        # After every size: a sweep cut short still leaves a plan for the sizes it reached.
        plan = ";".join(plan_entry(r, args.margin) for r in results)
        with open(args.out, "w") as f:
            json.dump({"device": device, "args": vars(args), "results": results, "plan": plan}, f)
        with open(args.plan_out, "w") as f:
            f.write(plan + "\n")
    print(f"plan: {plan}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
