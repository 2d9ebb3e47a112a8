"""Speculative decoding at batch 1 on one GPU: ms per output token with and without drafts.

    PYTHONPATH=. python3 benchmarks/h200/spec_decode_bench.py --out $OUT          # kvllm, 5 configs
    PYTHONPATH=.:/tmp/site-vllm python3 benchmarks/h200/spec_decode_bench.py --out $OUT --vllm

Qwen3-0.6B shapes with dummy bf16 weights, greedy, EOS ignored, one request at a time (batch 1),
each configuration in its own process (so each engine gets the whole GPU):
  draft_is_target  draft_model = the target itself (same seeded dummy weights), k = 3: every draft
                   agrees, so this is the ceiling of the mechanism (k + 1 tokens per target pass)
  ngram            n-gram lookup (k = 3, n 1..4) on a repetitive prompt (a 64-token run repeated 8x)
  none             no speculation, the same prompt
  ngram_rejected   n-gram verification with drafts that are never accepted (random token ids in
                   place of the lookup's): the overhead of verifying k = 3 drafts per step
  eagle_random     an EAGLE head with random weights (SafeAILab's format, one Llama layer, the
                   target's embedding and LM head), k = 3: acceptance about 0, so this is the cost of
                   running the head (eagerly; the target's steps in CUDA graphs) and verifying its drafts
For each: 1 warm-up request, then REPEATS requests of OUTPUT_LEN tokens; ms per output token = wall
time / output tokens; acceptance counts from the engine. kvllm records also say which steps replayed
full CUDA graphs: `graph_replays` by model ("target"; "draft_step": the draft model's pass over a
step's tokens, which decode-only steps skip; "draft_propose": its proposal steps, the first of two
tokens per request after a decode-only step) and query tokens per request (1, 2, or k + 1 for a
verification), and `verify_steps` / `verify_steps_graphed` (steps with drafts / those in a full graph).
With --vllm the first three run on vLLM (its defaults: torch.compile, CUDA graphs; `none` first, so
the other two reuse its compile cache); vLLM has no forced-rejection mode. One JSON line per
configuration goes to stdout and to OUT/spec_decode.jsonl; a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.h200.torch_profile import profile_call  # noqa: E402

OUTPUT_LEN = 256
REPEATS = 3
K = 3
MODEL_DIR = "/tmp/qwen3-0.6b-shape"
EAGLE_DIR = "/tmp/qwen3-0.6b-shape-eagle-random"
CONFIGS = ("draft_is_target", "ngram", "none", "ngram_rejected", "eagle_random")


def write_random_eagle_head(target: str, folder: str) -> None:
    """An EAGLE-1 head for the target's shapes with random weights (std 0.02), no embedding or LM head."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(target) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    generator = torch.Generator().manual_seed(0)
    shapes = {
        "fc.weight": (hidden, 2 * hidden),
        "layers.0.self_attn.q_proj.weight": (heads * head_dim, hidden),
        "layers.0.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "layers.0.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "layers.0.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": (inter, hidden),
        "layers.0.mlp.up_proj.weight": (inter, hidden),
        "layers.0.mlp.down_proj.weight": (hidden, inter),
    }
    tensors = {name: 0.02 * torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    tensors["layers.0.post_attention_layernorm.weight"] = torch.ones(hidden)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(out / "model.safetensors"))
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    head = {k: config[k] for k in keys} | {"head_dim": head_dim, "num_hidden_layers": 1}
    head |= {k: config[k] for k in ("rms_norm_eps", "rope_theta", "max_position_embeddings") if k in config}
    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **head}))


def prompt_ids(seed: int, vocab_size: int) -> list[int]:
    import random

    rng = random.Random(seed)
    run = [rng.randrange(3, min(vocab_size, 100000)) for _ in range(64)]
    return run * 8


def speculative_config(name: str, model: str) -> dict[str, Any] | None:
    if name == "draft_is_target":
        return {"method": "draft_model", "model": model, "num_speculative_tokens": K}
    if name == "eagle_random":
        return {"method": "eagle", "model": EAGLE_DIR, "num_speculative_tokens": K}
    if name in ("ngram", "ngram_rejected"):
        return {
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        }
    return None


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_one(name: str, engine: str, model: str, output_len: int, out: Path) -> dict[str, Any]:
    import torch

    spec = speculative_config(name, model)
    start = time.perf_counter()
    if engine == "vllm":
        from kvllm.benchmarks.vllm_backend import VLLM_ENV

        for key, value in VLLM_ENV.items():
            os.environ.setdefault(key, value)
        import vllm
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=model,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=4096,
            gpu_memory_utilization=0.85,
            seed=0,
            generation_config="vllm",
            enable_prefix_caching=False,
            speculative_config=None if spec is None else dict(spec),  # vLLM adds its own objects to it
            max_num_seqs=4,
            disable_log_stats=False,  # LLM turns stats off by default, and get_metrics() asserts on them
        )
        version = vllm.__version__
    else:
        from kvllm import LLM, SamplingParams

        if name == "ngram_rejected":  # drafts the target (almost) never agrees with: random ids
            import kvllm.spec_decode.ngram as ngram

            generator = torch.Generator().manual_seed(0)

            def never_accepted(self, token_ids, max_drafts=None):
                k = self.k if max_drafts is None else min(self.k, max_drafts)
                return torch.randint(3, 512, (max(k, 0),), generator=generator).tolist()

            ngram.NgramProposer.propose = never_accepted
        llm = LLM(
            model,
            load_format="dummy",
            dtype="bfloat16" if torch.cuda.is_available() else "float32",
            max_model_len=4096 if torch.cuda.is_available() else 1024,
            enable_prefix_caching=False,
            speculative_config=None if spec is None else dict(spec),  # vLLM adds its own objects to it
            # Batch 1 only: a small batch keeps start-up (graph capture, warm-up) short.
            max_num_seqs=4,
            cudagraph_capture_sizes=[1, 2, 4],
            max_num_batched_tokens=1024,  # the 512-token prompt in one step; fewer piecewise graphs
        )
        version = "kvllm"
    startup_s = time.perf_counter() - start
    vocab_size = llm.llm_engine.model_config.vocab_size if engine == "kvllm" else 151936
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)

    def one(seed: int) -> int:
        out = llm.generate([{"prompt_token_ids": prompt_ids(seed, vocab_size)}], params, use_tqdm=False)
        return len(out[0].outputs[0].token_ids)

    one(100)  # warm-up
    _sync()
    t0 = time.perf_counter()
    tokens = sum(one(seed) for seed in range(REPEATS))
    _sync()
    wall = time.perf_counter() - t0
    record: dict[str, Any] = {
        "engine": version,
        "config": name,
        "speculative_config": spec,
        "batch": 1,
        "output_tokens": tokens,
        "ms_per_output_token": 1000 * wall / tokens,
        "startup_s": startup_s,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    if engine == "kvllm":
        eng = llm.llm_engine
        record["attention_backend"] = eng.attention_backend_name
        runner = eng.executor.worker.model_runner
        record["cuda_graphs"] = runner.graph_runner is not None
        record["graph_replays"] = {
            name: {str(q): n for q, n in by_len.items()}
            for name, by_len in runner.graph_replay_counts().items()
        }
        record["verify_steps"] = runner.num_verify_steps
        record["verify_steps_graphed"] = runner.num_verify_steps_graphed
        record["ungraphed_verify_steps"] = runner.ungraphed_verify_steps  # (requests, longest query, tokens)
        record["mixed_verify_steps"] = runner.num_mixed_verify_steps  # beside a prefill chunk (warm-up)
        if eng.spec_decode is not None:
            s = eng.spec_decode.stats
            record.update(
                num_drafts=s.num_drafts,
                num_draft_tokens=s.num_draft_tokens,
                num_accepted_tokens=s.num_accepted_tokens,
                num_accepted_tokens_per_pos=s.num_accepted_tokens_per_pos,
                acceptance_rate=s.acceptance_rate,
                mean_tokens_per_verification=(s.num_accepted_tokens + s.num_drafts) / max(s.num_drafts, 1),
            )
        tokens: list[int] = []
        profile = profile_call(lambda: tokens.append(one(200)), out / f"spec-profile-{name}.txt", name)
        record["profile"] = {**profile, "tokens": tokens[0]}  # after the counts: not in them
    else:
        metrics = {m.name: m for m in llm.get_metrics()}
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            m = metrics.get(f"vllm:spec_decode_{key}")
            if m is not None:
                record[key] = m.value
        if record.get("num_draft_tokens"):
            record["acceptance_rate"] = record["num_accepted_tokens"] / record["num_draft_tokens"]
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    parser.add_argument("--vllm", action="store_true", help="run the first three configurations on vLLM")
    parser.add_argument("--model", help="a model folder instead of the Qwen3-0.6B shapes (CPU smoke runs)")
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # CONFIG:ENGINE, in a child process
    args = parser.parse_args()
    model = args.model or MODEL_DIR
    if args.one:
        name, engine = args.one.split(":")
        print(
            "RESULT " + json.dumps(run_one(name, engine, model, args.output_len, Path(args.out))), flush=True
        )
        return 0
    if args.model is None:
        from kvllm.benchmarks.model_shapes import write_shape_only_model

        write_shape_only_model("Qwen3-0.6B", MODEL_DIR)
    write_random_eagle_head(model, EAGLE_DIR)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # vLLM: the plain target first, so the speculative configurations reuse its compile cache.
    vllm_order = ("none", "ngram", "draft_is_target")
    runs = [(c, "vllm") for c in vllm_order] if args.vllm else [(c, "kvllm") for c in CONFIGS]
    bench_start = time.perf_counter()
    records = []
    results = out / ("spec_decode-vllm.jsonl" if args.vllm else "spec_decode.jsonl")
    results.write_text("")  # one line per configuration as it finishes: a timeout keeps the earlier ones
    for name, engine in runs:
        log = out / f"spec-{engine}-{name}.log"
        with open(log, "w") as f:
            proc = subprocess.run(
                [sys.executable, __file__, "--one", f"{name}:{engine}", "--model", model]
                + ["--output-len", str(args.output_len), "--out", str(out)],
                stdout=subprocess.PIPE,
                stderr=f,
                text=True,
                timeout=240,
            )
        lines = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        record = (
            json.loads(lines[-1])
            if lines
            else {"engine": engine, "config": name, "error": f"exit {proc.returncode}, see {log.name}"}
        )
        record["process_s"] = round(time.perf_counter() - bench_start, 1)  # cumulative wall time
        records.append(record)
        print(json.dumps(record), flush=True)
        with open(results, "a") as f:
            f.write(json.dumps(record) + "\n")
    print(f"\n{'engine':>8} {'config':>16} {'ms/token':>9} {'accept':>7} {'tok/verify':>10} {'graphed':>9}")
    for r in records:
        rate = r.get("acceptance_rate")
        per = r.get("mean_tokens_per_verification")
        graphed = f"{r['verify_steps_graphed']}/{r['verify_steps']}" if r.get("verify_steps") else ""
        print(
            f"{r['engine']:>8} {r['config']:>16} {r.get('ms_per_output_token', float('nan')):9.2f} "
            f"{'' if rate is None else f'{rate:.2f}':>7} {'' if per is None else f'{per:.2f}':>10} {graphed:>9}"
        )
    print(f"total {time.perf_counter() - bench_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
