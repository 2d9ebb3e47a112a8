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
