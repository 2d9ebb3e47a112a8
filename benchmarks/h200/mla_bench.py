"""MLA decode kernels on a CUDA GPU: TRITON_MLA's kernel beside FlashInfer's MLA wrapper on the same
latent cache, a tile-config sweep of the Triton kernel, and the DeepSeek-V2-Lite-shaped model folder.

`PYTHONPATH=. python benchmarks/h200/mla_bench.py kernels --out $OUT/mla_kernels.json [--sweep]` times
decode at DeepSeek dims (kv_lora_rank 512, rope 64; 16 heads as V2-Lite, 128 as V3) for batch x
context, bf16, block 16, and reports the latent bytes read per second (the kernel's floor: B x context
x 576 x 2 bytes) and the tensor-core rate (2 x B x H x context x (576 + 512) flops). Triton is timed
as a CUDA graph of 10 calls (what an engine graph step sees: no launch overhead) and as 20
back-to-back calls (`_loop`); FlashInfer's planned wrapper likewise (graph time when its run
captures, else the back-to-back time). `--sweep` adds,
within `--budget-s`, every config of SWEEP_CONFIGS x split counts on SWEEP_SHAPES, each checked
against the table config's output. The JSON is rewritten after every record, so a timeout keeps
what was measured.
`... mla_bench.py model DIR` writes the V2-Lite-shaped config (27 layers, 64 routed + 2 shared experts,
kv_lora_rank 512) and a tokenizer to DIR, for benchmarks/h200/mla_e2e.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

SHAPES = [(heads, batch, ctx) for heads in (16, 128) for batch in (1, 32, 128) for ctx in (1024, 4096)]
SWEEP_SHAPES = [
    (16, 1, 4096),
    (16, 32, 4096),
    (16, 128, 4096),
    (128, 1, 4096),
    (128, 32, 4096),
    (128, 128, 4096),
]
# (block_h, block_n, num_warps, num_stages), most promising first: the sweep runs config by config
# (each compiles once) over every shape, so a budget cut drops configs, never shapes.
SWEEP_CONFIGS = [
    (16, 32, 4, 2), (64, 32, 8, 2), (32, 32, 4, 2), (16, 64, 4, 2), (64, 16, 8, 2), (16, 16, 4, 2),
    (32, 64, 8, 2), (64, 32, 8, 1), (16, 32, 4, 3), (32, 32, 8, 2), (16, 64, 8, 2), (64, 64, 8, 1),
    (16, 32, 2, 2), (32, 16, 4, 2), (64, 16, 4, 2),
]  # fmt: skip
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64)
BLOCK = 16
L, R = 512, 64
SCALE = 192**-0.5


def loop_us(fn, calls: int = 20) -> float:
    """Mean GPU time per call of `calls` back-to-back calls (host launch time included when larger)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def graph_us(fn, calls: int = 10) -> float:
    """Mean time per call of a CUDA graph of `calls` calls (median of 5 replays)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def make_case(heads: int, batch: int, ctx: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    pages = -(-ctx // BLOCK)
    cache = torch.randn(batch * pages + 1, BLOCK, L + R, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(batch, heads, L + R, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(batch * pages, device="cuda", generator=gen).int().view(batch, pages)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return q, cache, table, seq_lens


def rates(us: float, heads: int, batch: int, ctx: int) -> tuple[float, float]:
    """(GB/s of latent read, TFLOP/s of the two products)."""
    latent_bytes = batch * ctx * (L + R) * 2
    flops = 2 * batch * heads * ctx * (L + R + L)
    return latent_bytes / us / 1e3, flops / us / 1e6


class Writer:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.doc = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "records": [],
            "sweep": [],
        }

    def add(self, key: str, rec: dict) -> None:
        self.doc[key].append(rec)
        print(json.dumps(rec), flush=True)
        self.out.write_text(json.dumps(self.doc, indent=1))


def flashinfer_wrapper():
    if importlib.util.find_spec("flashinfer") is None:
        return None
    from kvllm.attention.backends.flashinfer_impl import WORKSPACE_BYTES, import_flashinfer

    fi = import_flashinfer()
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    return fi.mla.BatchMLAPagedAttentionWrapper(workspace, backend="fa2")


def kernels(writer: Writer) -> None:
    from kvllm.attention.backends.mla.triton_mla_impl import _num_sms
    from kvllm.attention.ops.triton_mla_decode import decode_config, mla_decode, num_splits_for

    try:
        wrapper = flashinfer_wrapper()
    except Exception as exc:  # noqa: BLE001 - reported, the Triton numbers still count
        wrapper = None
        writer.doc["flashinfer_error"] = f"{type(exc).__name__}: {exc}"
    num_sms = _num_sms(torch.device("cuda"))
    for heads, batch, ctx in SHAPES:
        rec: dict = {"heads": heads, "batch": batch, "context": ctx}
        try:
            q, cache, table, seq_lens = make_case(heads, batch, ctx)
            config = decode_config(heads, q.dtype)
            splits = num_splits_for(batch, heads, config, ctx, num_sms)
            rec.update(num_splits=splits, config=list(config.__dict__.values()))
            fn = partial(mla_decode, q, cache, table, seq_lens, L, SCALE, num_splits=splits, config=config)
            triton_out = fn()
            rec["triton_us"] = graph_us(fn)
            rec["triton_GBps"], rec["triton_TFLOPs"] = rates(rec["triton_us"], heads, batch, ctx)
            rec["triton_loop_us"] = loop_us(fn)
            if wrapper is not None:
                kv_indptr = torch.arange(batch + 1, dtype=torch.int32) * table.shape[1]
                wrapper.plan(
                    torch.arange(batch + 1, dtype=torch.int32), kv_indptr, table.flatten(),
                    seq_lens.cpu(), heads, L, R, BLOCK, False, SCALE, q.dtype, cache.dtype,
                )  # fmt: skip
                qn, qp = q[..., :L].contiguous(), q[..., L:].contiguous()
                fi_fn = partial(wrapper.run, qn, qp, cache[..., :L], cache[..., L:])
                fi_out = fi_fn()
                rec["flashinfer_loop_us"] = loop_us(fi_fn)
                try:  # run() after a plan is a kernel launch on the plan's buffers: capturable
                    rec["flashinfer_us"] = graph_us(fi_fn)
                except Exception as exc:  # noqa: BLE001 - then only the back-to-back time counts
                    rec["flashinfer_graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                fi_us = rec.get("flashinfer_us", rec["flashinfer_loop_us"])
                rec["flashinfer_GBps"], rec["flashinfer_TFLOPs"] = rates(fi_us, heads, batch, ctx)
                rec["max_abs_diff_vs_flashinfer"] = (fi_out.float() - triton_out.float()).abs().max().item()
            del q, cache, table
        except Exception as exc:  # noqa: BLE001 - one shape failing must not lose the others
            rec["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        writer.add("records", rec)


def sweep(writer: Writer, budget_s: float) -> None:
    from kvllm.attention.backends.mla.triton_mla_impl import _num_sms
    from kvllm.attention.ops.triton_mla_decode import (
        MLADecodeConfig,
        decode_config,
        mla_decode,
        num_splits_for,
    )

    deadline = time.monotonic() + budget_s
    num_sms = _num_sms(torch.device("cuda"))
    cases = []
    safe = MLADecodeConfig(16, 16, 4, 1)  # the reference: the smallest tiles, one segment
    for heads, batch, ctx in SWEEP_SHAPES:
        q, cache, table, seq_lens = make_case(heads, batch, ctx)
        ref = mla_decode(q, cache, table, seq_lens, L, SCALE, num_splits=1, config=safe).float()
        heuristic = num_splits_for(batch, heads, decode_config(heads, q.dtype), ctx, num_sms)
        cases.append(((heads, batch, ctx), (q, cache, table, seq_lens), ref, heuristic))
    for bh, bn, warps, stages in SWEEP_CONFIGS:
        config = MLADecodeConfig(bh, bn, warps, stages)
        for (heads, batch, ctx), args, ref, heuristic in cases:
            if bh > max(16, heads):
                continue
            programs = batch * -(-heads // bh)
            for splits in SWEEP_SPLITS:
                if time.monotonic() > deadline:
                    writer.doc["sweep_truncated"] = True
                    writer.out.write_text(json.dumps(writer.doc, indent=1))
                    return
                if splits > 1 and (programs * splits > 8 * num_sms or ctx // splits < 64):
                    continue
                rec = {"heads": heads, "batch": batch, "context": ctx, "config": [bh, bn, warps, stages],
                       "num_splits": splits, "heuristic_splits": heuristic}  # fmt: skip
                try:
                    fn = partial(mla_decode, *args, L, SCALE, num_splits=splits, config=config)
                    rec["max_abs_diff"] = (fn().float() - ref).abs().max().item()
                    rec["us"] = graph_us(fn)
                    rec["GBps"], rec["TFLOPs"] = rates(rec["us"], heads, batch, ctx)
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: recorded
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                writer.add("sweep", rec)


def summary(doc: dict) -> None:
    print(
        f"{'H':>4} {'B':>4} {'ctx':>5} {'splits':>6} {'triton us':>10} {'GB/s':>6} {'TF/s':>5} {'loop us':>8} {'flashinfer us':>13} {'GB/s':>6}"
    )
    for r in doc["records"]:
        if "error" in r:
            print(f"{r['heads']:>4} {r['batch']:>4} {r['context']:>5} error {r['error'][:80]}")
            continue
        fi_us = r.get("flashinfer_us", r.get("flashinfer_loop_us", float("nan")))
        fi = f"{fi_us:13.1f} {r.get('flashinfer_GBps', float('nan')):6.0f}"
        print(f"{r['heads']:>4} {r['batch']:>4} {r['context']:>5} {r['num_splits']:>6} {r['triton_us']:10.1f} "
              f"{r['triton_GBps']:6.0f} {r['triton_TFLOPs']:5.0f} {r['triton_loop_us']:8.1f} {fi}")  # fmt: skip
    best: dict = {}
    for r in doc["sweep"]:
        key = (r["heads"], r["batch"], r["context"])
        if "us" in r and r["max_abs_diff"] < 0.05 and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    for key, r in best.items():
        print(f"sweep best H{key[0]} B{key[1]} ctx{key[2]}: config {r['config']} splits {r['num_splits']} "
              f"{r['us']:.1f} us {r['GBps']:.0f} GB/s (heuristic splits {r['heuristic_splits']})")  # fmt: skip


def model(folder: Path) -> None:
    """DeepSeek-V2-Lite's config (public shapes), random weights come from --load-format dummy."""
    from transformers import DeepseekV2Config

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.model_factory import write_tokenizer

    write_tokenizer(folder)
    config = DeepseekV2Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        n_group=1, topk_group=1, topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False,
        max_position_embeddings=163840, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                         "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
        architectures=["DeepseekV2ForCausalLM"], dtype="bfloat16",
    )  # fmt: skip
    config.save_pretrained(folder)
    print(f"wrote {folder}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--out", type=Path, required=True)
    k.add_argument("--sweep", action="store_true")
    k.add_argument("--budget-s", type=float, default=60.0, help="stop the sweep after this long")
    m = sub.add_parser("model")
    m.add_argument("folder", type=Path)
    args = parser.parse_args()
    if args.cmd == "model":
        model(args.folder)
        return
    writer = Writer(args.out)
    kernels(writer)
    if args.sweep:
        sweep(writer, args.budget_s)
    summary(writer.doc)


if __name__ == "__main__":
    main()
