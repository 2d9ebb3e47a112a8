"""MLA on a CUDA GPU: the decode kernels alone (TRITON_MLA's kernel beside FlashInfer's MLA wrapper on the
same latent cache), and a DeepSeek-V2-Lite-shaped model folder for the end-to-end runs.

`PYTHONPATH=. python benchmarks/h200/mla_bench.py kernels --out $OUT/mla_kernels.json` times decode at
DeepSeek dims (kv_lora_rank 512, rope 64; 16 heads as V2-Lite, 128 as V3) for batch x context, bf16,
block 16, with CUDA events (median of 20 after 3 warm-ups), checks both against each other, and reports
the latent bytes read per second (the kernel's floor: B x context x 576 x 2 bytes).
`... mla_bench.py model DIR` writes the V2-Lite-shaped config (27 layers, 64 routed + 2 shared experts,
kv_lora_rank 512) and a tokenizer to DIR, for `kvllm bench throughput DIR --load-format dummy`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

SHAPES = [(heads, batch, ctx) for heads in (16, 128) for batch in (1, 32, 128) for ctx in (1024, 4096)]
BLOCK = 16


def time_us(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def kernels(out: Path) -> None:
    from kvllm.attention.backends.mla.triton_mla_impl import _num_sms, num_splits_for
    from kvllm.attention.ops.triton_mla_decode import mla_decode

    has_fi = importlib.util.find_spec("flashinfer") is not None
    wrapper = None
    if has_fi:
        from kvllm.attention.backends.flashinfer_impl import WORKSPACE_BYTES, import_flashinfer

        fi = import_flashinfer()
        wrapper = fi.mla.BatchMLAPagedAttentionWrapper(
            torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"), backend="fa2"
        )
    records = []
    L, R, scale = 512, 64, 192**-0.5
    for heads, batch, ctx in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        pages = -(-ctx // BLOCK)
        cache = torch.randn(
            batch * pages + 1, BLOCK, L + R, device="cuda", dtype=torch.bfloat16, generator=gen
        )
        q = torch.randn(batch, heads, L + R, device="cuda", dtype=torch.bfloat16, generator=gen)
        table = torch.randperm(batch * pages, device="cuda").int().view(batch, pages)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        splits = num_splits_for(batch * -(-heads // 16), ctx, _num_sms(torch.device("cuda")))
        triton_out = mla_decode(q, cache, table, seq_lens, L, scale, num_splits=splits)
        rec = {"heads": heads, "batch": batch, "context": ctx, "num_splits": splits}
        rec["triton_us"] = time_us(
            partial(mla_decode, q, cache, table, seq_lens, L, scale, num_splits=splits)
        )
        latent_bytes = batch * ctx * (L + R) * 2
        rec["triton_GBps"] = latent_bytes / rec["triton_us"] / 1e3
        if wrapper is not None:
            kv_indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
            wrapper.plan(
                torch.arange(batch + 1, dtype=torch.int32), kv_indptr, table.flatten(),
                seq_lens.cpu(), heads, L, R, BLOCK, False, scale, q.dtype, cache.dtype,
            )  # fmt: skip
            qn, qp = q[..., :L].contiguous(), q[..., L:].contiguous()
            ckv, kpe = cache[..., :L], cache[..., L:]
            fi_out = wrapper.run(qn, qp, ckv, kpe)
            rec["flashinfer_us"] = time_us(partial(wrapper.run, qn, qp, ckv, kpe))
            rec["flashinfer_GBps"] = latent_bytes / rec["flashinfer_us"] / 1e3
            rec["max_abs_diff_vs_flashinfer"] = (fi_out.float() - triton_out.float()).abs().max().item()
        records.append(rec)
        print(json.dumps(rec), flush=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "records": records}, indent=1))
    print(
        f"{'H':>4} {'B':>4} {'ctx':>5} {'splits':>6} {'triton us':>10} {'GB/s':>7} {'flashinfer us':>14} {'GB/s':>7}"
    )
    for r in records:
        fi = f"{r.get('flashinfer_us', float('nan')):14.1f} {r.get('flashinfer_GBps', float('nan')):7.0f}"
        print(
            f"{r['heads']:>4} {r['batch']:>4} {r['context']:>5} {r['num_splits']:>6} {r['triton_us']:10.1f} {r['triton_GBps']:7.0f} {fi}"
        )


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
    m = sub.add_parser("model")
    m.add_argument("folder", type=Path)
    args = parser.parse_args()
    kernels(args.out) if args.cmd == "kernels" else model(args.folder)


if __name__ == "__main__":
    main()
