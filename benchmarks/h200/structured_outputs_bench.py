"""Throughput at batch 64 with and without a JSON schema, Qwen3-0.6B-shaped dummy weights, real Qwen3
tokenizer (the grammar needs real token strings), on the GPU.

    PYTHONPATH=.:/tmp/so-site python benchmarks/h200/structured_outputs_bench.py \
        --tokenizer .so-bench/qwen3-tokenizer --out $OUT/structured_outputs.json

(/tmp/so-site: the staged wheels unzipped, `python -m zipfile -e WHEEL /tmp/so-site` each.) With
`--engine vllm` (PYTHONPATH=.:/tmp/site-vllm, staged as for the fast-path bench) the same model, prompts,
schema and sampling run on vLLM's `LLM` API with its defaults (xgrammar backend, async scheduling), so the
two losses compare; the host clock and the profile are kvllm's only.

Both runs decode the same number of steps: every row generates exactly --max-tokens tokens (the
schema asks for an array of at least that many digits, so no document ends early, and the
unconstrained run ignores EOS), so the difference is the cost of the masks: xgrammar's fill on the
host (overlapped with the forward pass) and the mask applied in the sampler. `benchmarks/h200/
stage-structured-outputs.sh` stages the wheels (xgrammar, tvm-ffi, pydantic) and the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.h200.torch_profile import profile_call  # noqa: E402

# Cut at max_tokens, a constrained row is a prefix of the schema's document: "[d,d,..." once whitespace is
# dropped; with disable_any_whitespace xgrammar writes exactly "[d, d, ..." (its separator is ", ").
DIGIT_ARRAY_PREFIX = re.compile(r"\[(?:[0-9](?:,[0-9])*,?)?")
COMPACT_DIGIT_ARRAY_PREFIX = re.compile(r"\[(?:[0-9](?:, ?[0-9])*(?:, ?)?)?")


def follows_digit_array(text: str, compact: bool = False) -> bool:
    """Whether `text` is a prefix of a JSON array of digits (`compact`: with no whitespace but the
    separator's one space, as asked; otherwise any JSON whitespace)."""
    if compact:
        return COMPACT_DIGIT_ARRAY_PREFIX.fullmatch(text) is not None
    return DIGIT_ARRAY_PREFIX.fullmatch("".join(text.split())) is not None


def build_model(tokenizer: Path, folder: Path) -> Path:
    from kvllm.benchmarks.model_shapes import QWEN3_0_6B

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**QWEN3_0_6B, "eos_token_id": [151645, 151643]}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


class HostClock:
    """Host time inside the functions a constrained step adds or grows, by wrapping them (the engine's
    code is unchanged): the mask fill, each token's accept, and the engine's output update."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner: type, name: str, label: str) -> None:
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.ms[label] = self.ms.get(label, 0.0) + (time.perf_counter() - started) * 1e3
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(owner, name, timed)

    def take(self) -> dict[str, dict[str, float]]:
        taken = {k: {"ms": round(v, 2), "calls": self.calls[k]} for k, v in self.ms.items()}
        self.ms, self.calls = {}, {}
        return taken


def cprofile_call(call, path: Path) -> None:
    """Run `call` once under cProfile; write its 40 costliest functions by own time to `path`."""
    import cProfile
    import pstats

    path.parent.mkdir(parents=True, exist_ok=True)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    call()
    profiler.disable()
    with open(path, "w") as f:
        f.write(f"one run under cProfile: {time.perf_counter() - start:.3f} s\n")
        pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(40)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, type=Path)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--threaded-fill-min-rows",
        type=int,
        help="override kvllm's THREADED_FILL_MIN_ROWS (rows from which xgrammar's thread pool fills masks)",
    )
    parser.add_argument("--engine", choices=("kvllm", "vllm"), default="kvllm")
    parser.add_argument(
        "--grammar-process", action="store_true", help="kvllm's matchers in a process of their own"
    )
    parser.add_argument("--host-clock", action="store_true", help="time the fill, accepts and updates")
    parser.add_argument(
        "--profile-dir",
        type=Path,
        help="after the timed runs, one more run of each under torch.profiler: GPU busy and op tables here",
    )
    parser.add_argument(
        "--cprofile-dir",
        type=Path,
        help="after the timed runs, one more run of each under cProfile: the 40 costliest functions here",
    )
    args = parser.parse_args()

    import torch

    folder = build_model(args.tokenizer, Path(tempfile.mkdtemp()) / "qwen3-0.6b-shape")
    schema = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": args.max_tokens,
    }
    clock = HostClock()
    if args.engine == "vllm":
        if (
            args.host_clock
            or args.profile_dir
            or args.cprofile_dir
            or args.threaded_fill_min_rows is not None
            or args.grammar_process
        ):
            parser.error(
                "--host-clock, --profile-dir, --cprofile-dir, --threaded-fill-min-rows and --grammar-process are "
                "kvllm's only"
            )
        import os

        from kvllm.benchmarks.vllm_backend import VLLM_ENV

        for key, value in VLLM_ENV.items():  # as kvllm's own vLLM peer runs it (no FlashInfer sampler)
            os.environ.setdefault(key, value)
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        threaded_fill_min_rows = None
    else:
        from kvllm import LLM, SamplingParams
        from kvllm.engine.llm_engine import LLMEngine
        from kvllm.sampling_params import StructuredOutputsParams
        from kvllm.structured_output import backend_xgrammar, manager
        from kvllm.structured_output.grammar_process import GrammarProcessRequest
        from kvllm.structured_output.request import StructuredOutputRequest

        if args.threaded_fill_min_rows is not None:
            backend_xgrammar.THREADED_FILL_MIN_ROWS = args.threaded_fill_min_rows
        threaded_fill_min_rows = backend_xgrammar.THREADED_FILL_MIN_ROWS
        if args.host_clock:
            # The engine thread's share: with --grammar-process, the mask's start (send) and finish
            # (wait for the child, after the previous step's outputs) are apart.
            clock.wrap(manager.StructuredOutputManager, "start_bitmask", "mask_start")
            clock.wrap(manager.StructuredOutputManager, "finish_bitmask", "mask_finish")
            owner = GrammarProcessRequest if args.grammar_process else StructuredOutputRequest
            clock.wrap(owner, "accept_token", "accept_token")
            clock.wrap(LLMEngine, "_update", "engine_update")
    kwargs = {"grammar_process": True} if args.grammar_process else {}
    llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", max_model_len=1024, seed=0, **kwargs)
    # vLLM's engine runs in its own process; kvllm's here (no CUDA on the CPU for a smoke run)
    sync = torch.cuda.synchronize if args.engine == "kvllm" and torch.cuda.is_available() else lambda: None

    def sampling(name: str, max_tokens: int):
        constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return SamplingParams(
            temperature=1.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            structured_outputs=constraint if name == "json_schema" else None,
        )

    runs = {name: sampling(name, args.max_tokens) for name in ("unconstrained", "json_schema")}
    prompts = [f"Request {i}: list digits as JSON." for i in range(args.batch)]
    llm.generate(prompts[:2], sampling("json_schema", 8), use_tqdm=False)  # compile once
    result: dict = {
        "engine": args.engine,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "threaded_fill_min_rows": threaded_fill_min_rows,
        "grammar_process": args.grammar_process,
    }
    for name, params in runs.items():
        llm.generate(prompts, sampling(name, 16), use_tqdm=False)  # warm
        clock.take()
        times, tokens, valid = [], 0, None
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            sync()
            times.append(time.perf_counter() - t0)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            if name == "json_schema":
                texts = [o.outputs[0].text for o in outs]
                valid = sum(follows_digit_array(t) for t in texts)
                compact = sum(follows_digit_array(t, compact=True) for t in texts)
        best = min(times)
        result[name] = {
            "seconds": [round(t, 4) for t in times],
            "output_tokens": tokens,
            "tokens_per_s": round(tokens / best, 1),
            "median_tokens_per_s": round(tokens / statistics.median(times), 1),
        }
        if valid is not None:
            result[name]["rows_following_the_grammar"] = valid
            result[name]["rows_without_free_whitespace"] = compact
        result[name]["sample_texts"] = [o.outputs[0].text[:48] for o in outs[:2]]  # what "following" judged
        if args.host_clock:  # per decode step: the runs' steps are repeats x max_tokens
            steps = args.repeats * args.max_tokens
            result[name]["host_ms_per_step"] = {k: round(v["ms"] / steps, 4) for k, v in clock.take().items()}
        if args.profile_dir:
            result[name]["profile"] = profile_call(
                lambda params=params: llm.generate(prompts, params, use_tqdm=False),
                args.profile_dir / f"so-profile-{name}.txt",
                name,
            )
            clock.take()
        if args.cprofile_dir:
            cprofile_call(
                lambda params=params: llm.generate(prompts, params, use_tqdm=False),
                args.cprofile_dir / f"so-cprofile-{name}.txt",
            )
            clock.take()
    loss = 1 - result["json_schema"]["tokens_per_s"] / result["unconstrained"]["tokens_per_s"]
    result["throughput_loss_pct"] = round(100 * loss, 2)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    print(
        f"{args.engine}, batch {args.batch} x {args.max_tokens}: {result['unconstrained']['tokens_per_s']} tok/s unconstrained, "
        f"{result['json_schema']['tokens_per_s']} tok/s with a JSON schema ({result['throughput_loss_pct']}% loss; "
        "target < 5%)"
    )


if __name__ == "__main__":
    main()
