"""A decode step's host work on the input side does not grow with context (counted work, not time):
block-table entries and token ids are uploaded only for what changed, never the whole table."""

from __future__ import annotations

from kvllm import LLM, SamplingParams
from kvllm.worker.input_batch import InputBatch


def test_per_step_uploads_do_not_grow_with_context(tiny_qwen3_path, monkeypatch):
    llm = LLM(str(tiny_qwen3_path), load_format="dummy", dtype="float32", max_model_len=1024)
    engine = llm.llm_engine
    uploads: list[tuple[int, int]] = []  # (block-table entries, token ids) sent by each step
    sync = InputBatch._sync_rows_to_device

    def counting(self):
        blocks = sum(len(ids) for _, ids in self._block_updates)
        tokens = sum(len(t) for _, t in self._new_tokens)
        uploads.append((blocks, tokens))
        return sync(self)

    monkeypatch.setattr(InputBatch, "_sync_rows_to_device", counting)
    params = SamplingParams(temperature=0, max_tokens=700, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": [7 + i] * (40 + 90 * i)} for i in range(3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 700 for o in outs)
    prefill, decodes = uploads[0], uploads[1:]
    assert prefill[1] == sum(len(p["prompt_token_ids"]) for p in prompts)
    # Decode steps: sampled ids stay on the device, and each request sends one block id when it
    # crosses a block boundary, whether its context is 40 tokens or 900.
    assert all(tokens == 0 for _, tokens in decodes)
    assert max(blocks for blocks, _ in decodes) <= len(prompts)
    block_size = engine.block_size
    assert sum(blocks for blocks, _ in uploads) == sum(
        -(-(len(p["prompt_token_ids"]) + 700) // block_size) for p in prompts
    )


def _python_calls(engine, num_steps: int) -> int:
    """Python function calls made by the next `num_steps` engine steps (sys.setprofile: counted
    work, not time)."""
    import sys

    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        for _ in range(num_steps):
            engine.step()
    finally:
        sys.setprofile(None)
    return calls


def test_per_step_python_work_does_not_grow_with_output_length(tiny_qwen3_path):
    """A decode step's Python work (scheduling, inputs, sampling, outputs) is the same 100 tokens
    into the requests' outputs as 20 tokens in, for streaming (DELTA) and final-only outputs."""
    from kvllm.sampling_params import RequestOutputKind

    llm = LLM(str(tiny_qwen3_path), load_format="dummy", dtype="float32", max_model_len=1024)
    engine = llm.llm_engine
    block_size = engine.block_size
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        # Prompts a whole number of blocks long, so the requests cross block boundaries together
        # and every window of block_size steps allocates the same blocks.
        params = SamplingParams(
            temperature=0, max_tokens=8 * block_size, ignore_eos=True, detokenize=False, output_kind=kind
        )
        for i in range(2):
            engine.add_request(f"{kind.name}-{i}", {"prompt_token_ids": [5 + i] * (2 * block_size)}, params)
        for _ in range(block_size):  # the prefill, and the first tokens
            engine.step()
        early = _python_calls(engine, block_size)
        for _ in range(4 * block_size):
            engine.step()
        late = _python_calls(engine, block_size)
        assert early == late, (kind, early, late)
        while engine.has_unfinished_requests():
            engine.step()


def test_generate_builds_each_request_output_once(tiny_qwen3_path, monkeypatch):
    """LLM.generate asks for final-only outputs: one RequestOutput per request, built when it
    finishes (not one per request per step), with the tokens of the step-by-step outputs."""
    from kvllm.engine.output_processor import OutputProcessor
    from kvllm.sampling_params import RequestOutputKind

    llm = LLM(str(tiny_qwen3_path), dtype="float32", max_model_len=256, seed=0)
    prompts = [{"prompt_token_ids": [7 + i, 9, 11 + 2 * i]} for i in range(3)]
    lengths = [5, 17, 30]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    cumulative = llm.generate(
        prompts, [p.replace(output_kind=RequestOutputKind.CUMULATIVE) for p in params], use_tqdm=False
    )

    built = []
    make_output = OutputProcessor._make_output

    def counting(self, parent, finished):
        built.append((parent.request_id, finished))
        return make_output(self, parent, finished)

    monkeypatch.setattr(OutputProcessor, "_make_output", counting)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(built) == len(prompts) and all(finished for _, finished in built)
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in cumulative]
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in cumulative]
