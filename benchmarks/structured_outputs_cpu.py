"""Host cost of constrained decoding per step, on the CPU: the grammar masks of a batch (xgrammar's
batched fill), the mask applied to the logits, and the sampler step they sit beside.

    PYTHONPATH=. python benchmarks/structured_outputs_cpu.py --tokenizer DIR [--batch 64] [--out FILE]
        [--schema object|digits] [--fill-only]

DIR holds the real Qwen3 tokenizer (tests fetch it into ~/.cache/kvllm-tests/qwen3-tokenizer-3.7.2).
Each of `--steps` steps fills the masks of `--batch` JSON-schema matchers, applies them to random
float32 logits of Qwen3's vocabulary, samples one allowed token per row and advances the matchers;
the medians are printed and written as JSON. `--schema digits` is the H200 bench's schema
(structured_outputs_bench.py: an array of at least 256 digits, no free whitespace); `--fill-only` skips
the logits and the sampler (tokens drawn uniformly from each mask on the host), for the host's mask
cost alone.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "tags", "score", "active"],
}
# benchmarks/h200/structured_outputs_bench.py's schema (with disable_any_whitespace).
DIGITS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 256}
VOCAB = 151936
EOS = (151645, 151643)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, type=Path)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--schema", choices=("object", "digits"), default="object")
    parser.add_argument("--fill-only", action="store_true")
    parser.add_argument("--fill-threads", type=int, help="xgrammar's fill threads (default: the manager's)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from kvllm.sample.metadata import SamplingMetadata
    from kvllm.sample.sampler import Sampler
    from kvllm.sample.structured import GrammarBitmaskInputs, unpack_bitmask
    from kvllm.sampling_params import SamplingParams, StructuredOutputsParams
    from kvllm.structured_output import StructuredOutputManager

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    manager = StructuredOutputManager(tokenizer, VOCAB, EOS)
    if args.fill_threads:
        manager._filler.fill_threads = args.fill_threads
    t0 = time.perf_counter()
    manager.backend  # noqa: B018 - the tokenizer's xgrammar view, built once per engine
    backend_s = time.perf_counter() - t0
    if args.schema == "digits":
        params = StructuredOutputsParams(json=DIGITS_SCHEMA, disable_any_whitespace=True)
    else:
        params = StructuredOutputsParams(json=SCHEMA)
    t0 = time.perf_counter()
    grammars = [manager.make_request(params) for _ in range(args.batch)]
    for g in grammars:
        while not g.is_ready():
            g.wait(1.0)
    compile_s = time.perf_counter() - t0

    sampler = Sampler(fused=False)
    md_params = [SamplingParams(temperature=1.0)] * args.batch
    fill, apply, sample, plain, accept = [], [], [], [], []
    for _ in range(args.steps):
        live = [g if g.constrains else None for g in grammars]
        if not any(live):
            break
        if args.fill_only:
            t0 = time.perf_counter()
            bitmask = manager.grammar_bitmask(live)
            fill.append(time.perf_counter() - t0)
            allowed = unpack_bitmask(bitmask, VOCAB)
            tokens = torch.multinomial(allowed.float(), 1).squeeze(1).tolist()
            t0 = time.perf_counter()
            for g, token in zip(grammars, tokens):
                g.accept_token(token)
            accept.append(time.perf_counter() - t0)
            continue
        logits = torch.randn(args.batch, VOCAB)
        md = SamplingMetadata.from_params(md_params, logits.device, VOCAB)
        t0 = time.perf_counter()
        sampler.sample(logits, md).to_host()
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        bitmask = manager.grammar_bitmask(live)
        fill.append(time.perf_counter() - t0)
        md.grammar = GrammarBitmaskInputs(bitmask)
        t0 = time.perf_counter()
        from kvllm.sample.structured import apply_grammar_bitmask

        apply_grammar_bitmask(logits, md.grammar)
        apply.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        tokens = sampler.sample(logits, md).to_host().token_ids
        sample.append(time.perf_counter() - t0)
        for g, token in zip(grammars, tokens):
            g.accept_token(token)
    ms = lambda xs: round(statistics.median(xs) * 1e3, 3) if xs else None  # noqa: E731
    p90 = lambda xs: round(sorted(xs)[int(0.9 * len(xs))] * 1e3, 3) if xs else None  # noqa: E731
    result = {
        "batch": args.batch,
        "vocab": VOCAB,
        "steps": len(fill),
        "tokenizer_info_s": round(backend_s, 3),
        "compile_batch_s": round(compile_s, 4),
        "schema": args.schema,
        "fill_threads": manager._filler.fill_threads,
        "fill_ms": ms(fill),
        "fill_p90_ms": p90(fill),
        "accept_ms": ms(accept),
        "apply_ms": ms(apply),
        "sample_with_mask_ms": ms(sample),
        "sample_without_mask_ms": ms(plain),
        "host": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "xgrammar": importlib.metadata.version("xgrammar"),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    print(
        f"batch {args.batch}: fill {result['fill_ms']} ms + apply {result['apply_ms']} ms per step; "
        f"sampling {result['sample_without_mask_ms']} ms -> {result['sample_with_mask_ms']} ms with the mask"
    )


if __name__ == "__main__":
    main()
