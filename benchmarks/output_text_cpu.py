"""The output processor's host time for a batch's text, per token and held to the end, on the CPU.

    PYTHONPATH=. python3 benchmarks/output_text_cpu.py [--batch 64] [--tokens 256] [--tokenizer DIR]

`--batch` sequences of `--tokens` random Qwen3 ids each (the real tokenizer, fetched as the tests do
unless --tokenizer names its folder) go through OutputProcessor._append_token step by step, every
sequence ending by length, once with CUMULATIVE outputs (one detokenizer update per token) and once with
FINAL_ONLY (LLM.generate's: the ids held and detokenized in one update when the sequence finishes). Prints
the host milliseconds per step of each, the finishing step included, best of 5.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvllm.core.request import Request  # noqa: E402
from kvllm.engine.output_processor import OutputProcessor  # noqa: E402
from kvllm.models.tokenizer import load_tokenizer  # noqa: E402
from kvllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402


def run_ms(tokenizer, kind: RequestOutputKind, ids: list[list[int]]) -> float:
    """Host ms per step of feeding ids[i][t] to sequence i at step t, until every sequence finished."""
    processor = OutputProcessor(tokenizer, max_model_len=1 << 20)
    params = SamplingParams(max_tokens=len(ids[0]), ignore_eos=True, output_kind=kind)
    seqs = []
    for i in range(len(ids)):
        request = Request(
            str(i), [1, 2, 3], params, params.max_tokens, (tokenizer.eos_token_id,), parent_id=str(i)
        )
        processor.add_request(str(i), None, [1, 2, 3], [request])
        seqs.append(processor.parents[str(i)].sequences[0])
    start = time.perf_counter()
    for step in range(len(ids[0])):
        for seq, row in zip(seqs, ids, strict=True):
            processor._append_token(seq, row[step], None, None)
    texts = [seq.text for seq in seqs]
    elapsed = time.perf_counter() - start
    assert all(seq.request.finish_reason == "length" for seq in seqs) and all(texts)
    return elapsed * 1e3 / len(ids[0])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--tokenizer", help="a folder with the Qwen3 tokenizer (default: fetched and cached)")
    args = parser.parse_args()
    if args.tokenizer is None:
        from tests import model_factory

        args.tokenizer = str(model_factory.fetch_qwen3_tokenizer(Path.home() / ".cache" / "kvllm-tests"))
    tokenizer = load_tokenizer(args.tokenizer)
    rng = random.Random(0)
    ids = [[rng.randrange(200, 150000) for _ in range(args.tokens)] for _ in range(args.batch)]
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        best = min(run_ms(tokenizer, kind, ids) for _ in range(5))
        print(f"{kind.name:<11} batch {args.batch} x {args.tokens} tokens: {best:.3f} host ms per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
