"""Where FLEX_ATTENTION's fresh prefill loses to torch's own compiled FlexAttention (issue 23: 8 x 2048 causal,
199.7 TFLOP/s against the peer's 263 on an H100 in the seventeenth session's first call).

    PYTHONPATH=. python3 benchmarks/h200/flex_prefill_probe.py [--out DIR]

One process, Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head size 128, bf16), every row timed
with the attention bench's queued timing (calls enqueued back to back between one pair of events) and checked
against the backend's own output (row `kernel, kvllm's inputs`) before it is timed:
- the backend's forward (the step's K/V write into the paged cache included), as the attention bench times it;
- the compiled flex call alone on the inputs the backend hands it (the step's rows viewed as [1, H, L, D],
  the packed document-causal BlockMask), then on contiguous copies of them, then with kernel options
  (USE_TMA; tiles, warps and stages) instead of FlexAttention's defaults;
- the peer: [8, H, 2048, D] contiguous, a causal BlockMask from create_block_mask.
Writes flex_prefill_probe.jsonl (one record per row) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvllm.attention.backends.flex_attention_impl import _get_compiled_flex  # noqa: E402
from kvllm.attention.backends.flex_attention_prefill import fresh_prefill  # noqa: E402
from kvllm.attention.reference import make_paged_batch  # noqa: E402
from kvllm.attention.registry import get_backend_class  # noqa: E402
from kvllm.attention.testing import prepare_backend_case  # noqa: E402
from kvllm.benchmarks.attention.main import queued_ms  # noqa: E402

HEADS, KV_HEADS, HEAD = 16, 8, 128
OPTIONS = {
    "USE_TMA": {"USE_TMA": True},
    "128x64 w4 s3": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    "128x64 w8 s3": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    "128x128 w8 s2": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    "64x128 w4 s3": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-out")
    parser.add_argument("--window-ms", type=float, default=150.0)
    parser.add_argument(
        "--cpu-check",
        action="store_true",
        help="2 x 256 on the CPU, each row run once and checked, nothing timed (a smoke test)",
    )
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu_check else "cuda")
    num_seqs, seq_len = (2, 256) if args.cpu_check else (8, 2048)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flops = 4 * num_seqs * seq_len * seq_len / 2 * HEADS * HEAD
    batch = make_paged_batch([seq_len] * num_seqs, [0] * num_seqs, HEADS, KV_HEADS, HEAD, 16, dtype=torch.bfloat16,
                             device=device, seed=0)  # fmt: skip
    case = prepare_backend_case(get_backend_class("FLEX_ATTENTION"), batch)
    fresh = fresh_prefill(case.metadata.query_start_loc_cpu, 0, None, device)
    kernel = _get_compiled_flex()
    scale = HEAD**-0.5

    def viewed(t: torch.Tensor) -> torch.Tensor:  # [L, H, D] -> [1, H, L, D], as the backend hands it
        return t.unsqueeze(0).transpose(1, 2)

    q, k, v = (viewed(t) for t in (batch.query, batch.new_keys, batch.new_values))
    qc, kc, vc = (t.contiguous() for t in (q, k, v))

    def flex(q, k, v, mask, options=None):
        return lambda: kernel(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, kernel_options=options)

    from torch.nn.attention.flex_attention import create_block_mask

    causal = create_block_mask(lambda b, h, qi, ki: qi >= ki, num_seqs, None, seq_len, seq_len, device=device)

    def split(t):  # [L, H, D] -> [B, H, S, D] contiguous
        return t.view(num_seqs, seq_len, *t.shape[1:]).transpose(1, 2).contiguous()

    qb, kb, vb = (split(t) for t in (batch.query, batch.new_keys, batch.new_values))
    rows = [
        ("backend forward (K/V write included)", case.forward, "rows"),
        ("kernel, kvllm's inputs", flex(q, k, v, fresh.block_mask), "bhld"),
        ("kernel, contiguous inputs", flex(qc, kc, vc, fresh.block_mask), "bhld"),
    ]
    rows += [
        (f"kernel, kvllm's inputs, {name}", flex(q, k, v, fresh.block_mask, o), "bhld")
        for name, o in OPTIONS.items()
    ]
    rows += [
        ("kernel, contiguous inputs, USE_TMA", flex(qc, kc, vc, fresh.block_mask, OPTIONS["USE_TMA"]), "bhld")
    ]
    rows += [("peer: [8, H, 2048, D], causal BlockMask", flex(qb, kb, vb, causal), "peer")]
    rows += [("peer, USE_TMA", flex(qb, kb, vb, causal, OPTIONS["USE_TMA"]), "peer")]
    reference = rows[1][1]()[0].transpose(0, 1).float()
    records = []
    for label, fn, layout in rows:
        record = {"row": label, "gpu": "cpu" if args.cpu_check else torch.cuda.get_device_name()}
        try:
            result = fn()
            if not args.cpu_check:
                torch.cuda.synchronize()
            if layout == "bhld":
                result = result[0].transpose(0, 1)
            elif layout == "peer":
                result = result.transpose(1, 2).reshape(num_seqs * seq_len, HEADS, HEAD)
            err = ((result.float() - reference).norm() / reference.norm()).item()
            record["rel_error_vs_kernel"] = err
            if not err < 2e-2:
                raise AssertionError(f"differs from the kernel's own row by {err:.2e}")
            if args.cpu_check:
                records.append(record)
                print(json.dumps(record), flush=True)
                continue
            host: list[float] = []
            ms = queued_ms(fn, args.window_ms, host)
            record.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, host_ms_per_call=host[-1])
        except Exception as exc:  # one variant that does not compile is a result
            record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        records.append(record)
        print(json.dumps(record), flush=True)
    with open(out / "flex_prefill_probe.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print(f"\n{'row':<50} {'ms':>8} {'TFLOP/s':>8} {'host ms':>8}")
    for r in records:
        if "ms" in r:
            print(f"{r['row']:<50} {r['ms']:8.4f} {r['tflops']:8.1f} {r['host_ms_per_call']:8.3f}")
        else:
            print(f"{r['row']:<50} {r.get('error', 'checked, not timed')[:80]}")


if __name__ == "__main__":
    main()
