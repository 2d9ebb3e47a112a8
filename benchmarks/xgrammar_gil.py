"""Whether xgrammar's per-step calls release the GIL: if they did, a thread could fill the next step's
grammar masks while the engine's Python (scheduling, input preparation) runs.

    .venv/bin/python benchmarks/xgrammar_gil.py [--rows 64] [--repeats 50] [--output-json FILE]

64 matchers of one JSON schema on the real Qwen3 tokenizer (tests' cache, fetched with npm), each
advanced into the document. Timed: the masks filled in a loop (`fill_next_token_bitmask` per row), the
same through `BatchGrammarMatcher(max_threads=1)`, a fixed pure-Python loop, and each fill beside the
Python loop in a second thread. Overlapped time near the sum means the fill holds the GIL; near the
larger of the two means it releases it. Also the per-row accept loop against `batch_accept_token`, and the
batch fill through xgrammar's thread pool (`--fill-threads`: median ms per fill at each pool size; kvllm
uses the pool from THREADED_FILL_MIN_ROWS rows).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch
import xgrammar as xgr
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import model_factory  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "digits": {"type": "array", "items": {"type": "integer"}, "minItems": 256},
    },
    "required": ["name", "digits"],
}


def python_work(n: int = 20_000) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def mean_ms(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def beside_python_ms(fn, repeats: int) -> float:
    """fn repeated in a thread while this thread repeats python_work: wall ms per repeat."""
    thread = threading.Thread(target=lambda: [fn() for _ in range(repeats)])
    start = time.perf_counter()
    thread.start()
    for _ in range(repeats):
        python_work()
    thread.join()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--output-json", type=Path)
    parser.add_argument("--fill-threads", default="1,2,4,8", help="pool sizes to time the batch fill with")
    args = parser.parse_args()
    sizes = args.fill_threads.split(",")
    if not all(n.strip().isdigit() and int(n) >= 1 for n in sizes):
        parser.error(f"--fill-threads takes comma-separated pool sizes >= 1, got {args.fill_threads!r}")
    pool_sizes = [int(n) for n in sizes]
    torch.set_num_threads(1)
    folder = model_factory.fetch_qwen3_tokenizer(Path.home() / ".cache" / "kvllm-tests")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model_factory.QWEN3_VOCAB_SIZE)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(args.rows)]
    for token in tokenizer.encode('{"name": "abc", "digits": [1, 2, 3'):
        for matcher in matchers:
            assert matcher.accept_token(token)
    bitmask = xgr.allocate_token_bitmask(args.rows, model_factory.QWEN3_VOCAB_SIZE)
    batch = xgr.BatchGrammarMatcher(max_threads=1)

    def fill_loop() -> None:
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch() -> None:
        batch.batch_fill_next_token_bitmask(matchers, bitmask)

    for _ in range(5):  # warm
        fill_loop(), fill_batch(), python_work()
    python_ms = mean_ms(python_work, args.repeats)
    result: dict = {"rows": args.rows, "python_loop_ms": round(python_ms, 3)}
    for name, fn in (("fill_loop", fill_loop), ("batch_fill", fill_batch)):
        alone = mean_ms(fn, args.repeats)
        beside = beside_python_ms(fn, args.repeats)
        result[name] = {
            "alone_ms": round(alone, 3),
            "beside_python_ms": round(beside, 3),
            "sum_ms": round(alone + python_ms, 3),
            "max_ms": round(max(alone, python_ms), 3),
        }
    digit = tokenizer.encode(", 5")[0]
    ids = [digit] * args.rows

    def accept_loop() -> None:
        for matcher, token in zip(matchers, ids):
            matcher.accept_token(token)

    def accept_batch() -> None:
        batch.batch_accept_token(matchers, ids)

    for name, fn in (("accept_loop", accept_loop), ("batch_accept", accept_batch)):
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            for matcher in matchers:
                matcher.rollback(1)
        result[name + "_ms"] = round(sorted(times)[len(times) // 2], 4)  # median
    result["batch_fill_median_ms_by_threads"] = {}
    for threads in pool_sizes:
        pooled = xgr.BatchGrammarMatcher(max_threads=threads)
        for _ in range(5):  # warm: the pool's threads start on the first call
            pooled.batch_fill_next_token_bitmask(matchers, bitmask)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            pooled.batch_fill_next_token_bitmask(matchers, bitmask)
            times.append((time.perf_counter() - start) * 1e3)
        result["batch_fill_median_ms_by_threads"][str(threads)] = round(sorted(times)[len(times) // 2], 4)
    result["cpu_count"] = os.cpu_count()
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
