"""benchmarks/host_step_cpu.py --graph-path measures the GPU's decode host path only while its stand-in
for the CUDA graphs is the one the model runner asks (it once stopped being, and the bench silently
measured eager steps with the model's time counted as the engine's)."""

from __future__ import annotations

from benchmarks.host_step_cpu import profile_batch, use_graph_path
from kvllm import LLM


def test_graph_path_replays_every_decode_step_and_times_the_model_apart(tiny_qwen3_path):
    llm = LLM(
        str(tiny_qwen3_path), device="cpu", dtype="float32", max_model_len=256, enable_prefix_caching=False
    )
    runner = llm.llm_engine.executor.worker.model_runner
    replay = use_graph_path(runner, [4])
    row = profile_batch(llm, 4, steps=8, input_len=16, detokenize=False, output_kind="final_only")
    assert row["decode_fast_path_steps"] == 8
    assert replay.num_replays >= 8
    phases = row["host_ms_per_step_by_phase"]
    assert phases["forward"] > 0  # the model's time is the forward's, not left in "engine"
