"""Where the forced prefill kernel's extra time at short prompts goes: per call, the host's launch time and
the GPU's time, of TRITON_ATTN's two prefill paths on one prefill request (Qwen3-0.6B's attention: 16
query heads, 8 KV heads, head size 128, pages of 16, bf16).

    PYTHONPATH=. python3 benchmarks/h200/prefill_launch_probe.py --out DIR            # GPU, about 30 s
    PYTHONPATH=. python3 benchmarks/h200/prefill_launch_probe.py --out DIR --smoke    # CPU interpreter

End to end the forced kernel made a 1,024-token prompt 2.8 ms slower (28 layers: 100 us a layer) while
winning from 4,096 tokens (docs/benchmarks.md, twenty-second session). Per variant and case this prints
`host_us` (a call's Python + launch time, measured over back-to-back calls without syncs) and `gpu_us`
(CUDA events over the same calls): a host cost shows in the first, a slow kernel in the second. Variants:
`unified` (the unified kernel, the default below the auto threshold), `prefill` (the prefill kernel as
routed: the step's K/V as TMA rows), `prefill-gatherkv` (as routed by auto: the step's K/V first read back
from the cache with `gather_step_kv`), `prefill-cacheonly` (no step K/V: every key from the cache), and
`descriptors` (building the two host TMA descriptors alone). `--profile-case` (default 1x1024) also runs
cProfile over each of `--profile-variants`' calls there and writes the top functions by own time, then by
cumulative time, to `probe-profile-VARIANT.txt`: where a launch's host time goes (Triton's launcher, the
descriptors' encoding, kvllm's own Python).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="1x512,1x1024,1x2048,1x4096,8x2048")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes: checks the script")
    parser.add_argument(
        "--profile-case", default="1x1024", help="the case whose launches are profiled ('' none)"
    )
    parser.add_argument("--profile-variants", default="unified,prefill,prefill-cacheonly")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import dataclasses

    import torch

    from kvllm.attention.backends.triton_attn_impl import gather_step_kv
    from kvllm.attention.ops.triton_prefill_config import TensorDescriptor, prefill_kernel_config
    from kvllm.attention.ops.triton_unified_attention import prefill_config, unified_attention

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    heads, kv_heads, head_size, block_size = 16, 8, 128, 16
    cases = "2x24" if args.smoke else args.cases
    profile_case = "2x24" if args.smoke and args.profile_case else args.profile_case
    iters = 1 if args.smoke else args.iters
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def probe_case(case: str) -> None:
        batch, prompt = (int(x) for x in case.split("x"))
        tokens = batch * prompt
        blocks_per_req = -(-prompt // block_size)
        num_blocks = batch * blocks_per_req + 1
        key_cache, value_cache = (
            rand(num_blocks, block_size, kv_heads, head_size),
            rand(num_blocks, block_size, kv_heads, head_size),
        )
        block_table = torch.randperm(num_blocks - 1, generator=gen)[: batch * blocks_per_req]
        block_table = block_table.view(batch, blocks_per_req).to(device=device, dtype=torch.int32)
        seq_lens = torch.full((batch,), prompt, dtype=torch.int32, device=device)
        query_start_loc = torch.arange(0, tokens + 1, prompt, dtype=torch.int32, device=device)
        positions = torch.arange(prompt, device=device).repeat(batch)
        req = torch.arange(batch, device=device).repeat_interleave(prompt)
        slots = (block_table[req, positions // block_size] * block_size + positions % block_size).to(
            torch.int64
        )
        query, out = (
            rand(tokens, heads, head_size),
            torch.empty(tokens, heads, head_size, dtype=dtype, device=device),
        )
        key, value = rand(tokens, kv_heads, head_size), rand(tokens, kv_heads, head_size)
        routed = prefill_kernel_config(head_size, heads // kv_heads, dtype, block_size)
        variants = {
            "unified": (prefill_config(head_size, heads // kv_heads, dtype), False, False),
            "prefill": (routed, True, False),
            "prefill-gatherkv": (routed, False, True),
            "prefill-cacheonly": (dataclasses.replace(routed, new_kv=False), False, False),
        }

        def call(cfg, pass_kv: bool, gather: bool) -> None:
            k, v = (key, value) if pass_kv else (None, None)
            if gather:
                k, v = gather_step_kv(key_cache, value_cache, slots)
            unified_attention(
                out, query, key_cache, value_cache, query_start_loc, seq_lens, block_table,
                num_reqs=batch, num_tokens=tokens, num_decode_reqs=0, scale=head_size**-0.5,
                prefill_cfg=cfg, key=k, value=v,
            )  # fmt: skip

        def descriptors(*_: object) -> None:
            rows, width = num_blocks * block_size, kv_heads * head_size
            for cache in (key_cache, value_cache):
                TensorDescriptor(cache.view(rows, width), [rows, width], [width, 1], [64, head_size])

        timed = {**{name: (call, spec) for name, spec in variants.items()}, "descriptors": (descriptors, ())}
        flops = 4 * batch * prompt * (prompt + 1) / 2 * heads * head_size
        for name, (fn, spec) in timed.items():
            for _ in range(2):
                fn(*spec)
            sync()
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            began = time.perf_counter()
            for _ in range(iters):
                fn(*spec)
            host_us = (time.perf_counter() - began) / iters * 1e6
            gpu_us = None
            if device == "cuda":
                end.record()
                end.synchronize()
                gpu_us = start.elapsed_time(end) / iters * 1e3
            record = {
                "case": case,
                "variant": name,
                "host_us": round(host_us, 1),
                "gpu_us": round(gpu_us, 1) if gpu_us is not None else None,
                "tflops": round(flops / gpu_us / 1e6, 1) if gpu_us and name != "descriptors" else None,
            }
            sink.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)
            if case == profile_case and name in args.profile_variants.split(","):
                profile(name, fn, spec)

    def profile(name: str, fn, spec: tuple) -> None:
        """`iters` calls' host time by function (own time first), synchronised before and after."""

        def calls() -> None:
            for _ in range(iters):
                fn(*spec)

        sync()
        profiler = cProfile.Profile()
        profiler.runcall(calls)
        sync()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(15)
        (out_dir / f"probe-profile-{name}.txt").write_text(f"{name}, {iters} calls\n{text.getvalue()}")

    with open(out_dir / "prefill_launch_probe.jsonl", "w") as sink:  # probe_case writes its records here
        for case in cases.split(","):
            probe_case(case)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
