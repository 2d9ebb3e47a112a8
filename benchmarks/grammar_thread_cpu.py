"""Whether the grammar thread hides a constrained step's grammar work behind a call that lets go of the
GIL (on a GPU: the CUDA graph's launch), on the CPU.

    .venv/bin/python benchmarks/grammar_thread_cpu.py [--rows 64] [--repeats 200] [--output-json FILE]

64 matchers of one JSON schema on the real Qwen3 tokenizer (tests' cache, fetched with npm), advanced into
the document. The grammar's work per step is kvllm's: one token accepted per row, then the batch fill
(BitmaskFiller). The launch is stood in for by time.sleep (it lets go of the GIL, as the graph launch does),
of `--launch-us` microseconds each. Timed, median ms per step: the launch alone, the grammar alone, both on
one thread (the engine before the grammar thread), and both through MasksAhead (the fill on the grammar thread
from launching() on, the engine's thread sleeping meanwhile). Threaded near the larger of the two means the
work is hidden; near the sum, not.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import xgrammar as xgr
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import model_factory  # noqa: E402

from kvllm.engine.grammar_thread import GrammarThread  # noqa: E402
from kvllm.structured_output.backend_xgrammar import BitmaskFiller  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "digits": {"type": "array", "items": {"type": "integer"}, "minItems": 256},
    },
    "required": ["name", "digits"],
}


def median_ms(step, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(times), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument(
        "--launch-us", default="0,100,200,400", help="stand-in launch lengths, comma-separated"
    )
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = model_factory.fetch_qwen3_tokenizer(Path.home() / ".cache" / "kvllm-tests")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model_factory.QWEN3_VOCAB_SIZE)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(args.rows)]
    for token in tokenizer.encode('{"name": "abc", "digits": [1, 2, 3'):
        for matcher in matchers:
            assert matcher.accept_token(token)
    digit = tokenizer.encode(", 5")[0]
    bitmask = xgr.allocate_token_bitmask(args.rows, model_factory.QWEN3_VOCAB_SIZE)
    filler = BitmaskFiller(fill_threads=1)
    every_row = list(range(args.rows))

    def grammar_work() -> torch.Tensor:
        for matcher in matchers:
            matcher.accept_token(digit)
        filler.fill(bitmask, matchers)
        for matcher in matchers:  # the next repeat accepts at the same place
            matcher.rollback(1)
        return bitmask

    grammar_thread = GrammarThread()
    result: dict = {
        "rows": args.rows,
        "repeats": args.repeats,
        "grammar_ms": median_ms(grammar_work, args.repeats),
    }
    for launch_us in (int(x) for x in args.launch_us.split(",")):

        def launch(seconds: float = launch_us / 1e6) -> None:
            if seconds:
                time.sleep(seconds)

        def one_thread() -> None:
            launch()
            grammar_work()

        def grammar_thread_step() -> None:
            ahead = grammar_thread.masks_ahead(lambda: None, grammar_work, args.rows)
            ahead.launching()
            launch()
            assert ahead(every_row) is bitmask

        for step in (launch, one_thread, grammar_thread_step):  # warm
            step()
        result[f"launch_{launch_us}us"] = {
            "launch_alone_ms": median_ms(launch, args.repeats),
            "one_thread_ms": median_ms(one_thread, args.repeats),
            "grammar_thread_ms": median_ms(grammar_thread_step, args.repeats),
        }
    grammar_thread.shutdown()
    result["versions"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "xgrammar": importlib.metadata.version("xgrammar"),
    }
    print(json.dumps(result, indent=2))
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
