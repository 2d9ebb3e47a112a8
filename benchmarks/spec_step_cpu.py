"""Host time of a speculative (n-gram) verification step vs a plain decode step, on the CPU.

    PYTHONPATH=. python3 benchmarks/spec_step_cpu.py [--steps 128] [--cprofile FILE.txt]

A tiny random-weight Qwen3 (the tests' model factory, forward almost free) at batch 1 with a
512-token repetitive prompt (a 64-token run repeated 8x, as benchmarks/h200/spec_decode_bench.py):
  none            no speculation (async scheduling on)
  ngram_rejected  n-gram, k = 3, drafts replaced by random ids (never accepted: 1 token per step)
  ngram           n-gram, k = 3, the lookup's drafts
Per configuration: the main thread's CPU time per engine step and per output token, by phase
(step_profile.py's PhaseTimer: schedule, prepare, model, sample, verify, wait, outputs, after_step
= SpecDecodeCoordinator.after_step, the n-gram lookup inside it as "propose"), and counted work per
step: host reads of device tensors (Tensor.tolist / .item / .cpu / .numpy calls) and the tokens the
n-gram proposer scanned.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = ("none", "ngram_rejected", "ngram")


def _phase_timer_class():
    spec = importlib.util.spec_from_file_location("step_profile", ROOT / "benchmarks/h200/step_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PhaseTimer


def run(name: str, model: str, steps: int, profiler=None) -> dict:
    import torch

    import kvllm.spec_decode.ngram as ngram
    from kvllm import LLM, SamplingParams
    from kvllm.sample import sampler as sampler_module
    from kvllm.spec_decode import verify as verify_module

    spec = None
    if name != "none":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        }
    original_propose = ngram.NgramProposer.propose
    if name == "ngram_rejected":
        generator = torch.Generator().manual_seed(0)

        def never_accepted(self, token_ids, max_drafts=None):
            k = self.k if max_drafts is None else min(self.k, max_drafts)
            return torch.randint(600, 700, (max(k, 0),), generator=generator).tolist()

        ngram.NgramProposer.propose = never_accepted
    try:
        llm = LLM(
            model,
            device="cpu",
            dtype="float32",
            max_model_len=2048,
            enable_prefix_caching=False,
            seed=0,
            speculative_config=spec,
        )
        engine = llm.llm_engine
        rng = random.Random(0)
        prompt = [rng.randrange(3, 500) for _ in range(64)] * 8
        params = SamplingParams(temperature=0.0, max_tokens=steps * 4 + 64, ignore_eos=True, detokenize=False)
        engine.add_request("r", {"prompt_token_ids": prompt}, params)
        for _ in range(4):
            engine.step()  # prefill, and warm
        request = engine.scheduler.running[0]
        timer = _phase_timer_class()(time.thread_time)
        runner = engine.executor.worker.model_runner
        timer.wrap(engine.scheduler, "schedule", "schedule")
        timer.wrap(runner.input_batch, "prepare", "prepare")
        timer.wrap(runner.model, "forward", "model")
        timer.wrap(runner.metadata_builder, "build", "model")
        timer.wrap(runner.model, "compute_logits", "model")
        timer.wrap(runner.sampler, "sample", "sample")
        timer.wrap(sampler_module.HostCopy, "wait", "wait")
        timer.wrap(verify_module.PendingVerification, "wait", "wait")
        timer.wrap(engine.output_processor, "process_step", "outputs")
        if engine.spec_decode is not None:
            timer.wrap(engine.spec_decode, "after_step", "after_step")
            if engine.spec_decode.proposer is not None:
                timer.wrap(engine.spec_decode.proposer, "propose", "propose")
        timer.wrap(engine, "step", "step")
        reads = {"n": 0}
        originals = {}
        for method in ("tolist", "item", "cpu", "numpy"):
            originals[method] = getattr(torch.Tensor, method)

            def counted(self, *a, _m=method, **kw):
                reads["n"] += 1
                return originals[_m](self, *a, **kw)

            setattr(torch.Tensor, method, counted)
        tokens_before = request.num_output_tokens
        if profiler is not None:
            profiler.enable()
        start = time.thread_time()
        try:
            for _ in range(steps):
                engine.step()
        finally:
            cpu = time.thread_time() - start
            if profiler is not None:
                profiler.disable()
            for method, fn in originals.items():
                setattr(torch.Tensor, method, fn)
        emitted = request.num_output_tokens - tokens_before
        phases = {k: v / steps * 1e3 for k, v in timer.totals.items()}
        timer.unwrap()
        step = phases.pop("step", 0.0)
        phases["engine_other"] = step - sum(v for k, v in phases.items() if k != "propose")
        stats = engine.spec_decode.stats if engine.spec_decode is not None else None
        return {
            "config": name,
            "steps": steps,
            "tokens_per_step": emitted / steps,
            "cpu_ms_per_step": cpu / steps * 1e3,
            "cpu_ms_per_token": cpu / max(emitted, 1) * 1e3,
            "host_reads_per_step": reads["n"] / steps,
            "acceptance": stats.acceptance_rate if stats else None,
            "ms_per_step_by_phase": phases,
        }
    finally:
        ngram.NgramProposer.propose = original_propose


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="each number's best of this many runs")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--cprofile", default=None, help="cProfile ngram_rejected's steps into this file")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from tests.model_factory import make_tiny_qwen3

    torch.set_num_threads(1)
    model = str(make_tiny_qwen3(Path(tempfile.mkdtemp(prefix="spec_step_cpu-")), vocab_size=1024))
    rows = []
    for name in args.configs.split(","):
        runs = [run(name, model, args.steps) for _ in range(args.repeats)]
        best = dict(runs[0])
        for key in ("cpu_ms_per_step", "cpu_ms_per_token"):
            best[key] = min(r[key] for r in runs)
        best["ms_per_step_by_phase"] = {
            k: min(r["ms_per_step_by_phase"][k] for r in runs) for k in runs[0]["ms_per_step_by_phase"]
        }
        rows.append(best)
        print(json.dumps(best), flush=True)
    if args.cprofile:
        profiler = cProfile.Profile()
        run("ngram_rejected", model, args.steps, profiler)
        with open(args.cprofile, "w") as f:
            stats = pstats.Stats(profiler, stream=f)
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(60)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
