"""LLM / LLMEngine behaviour: bad input, n > 1, seeds, stop strings, aborts, no leaked KV blocks."""

from __future__ import annotations

import pytest

from kvllm import LLM, SamplingParams
from kvllm.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def llm(tiny_qwen3_path):
    return LLM(str(tiny_qwen3_path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 22)


def assert_no_leak(llm: LLM) -> None:
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert not llm.llm_engine.has_unfinished_requests()


def test_text_prompts_and_token_prompts_agree(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    text_out = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    ids = llm.get_tokenizer()("The capital of France is").input_ids
    ids_out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert text_out.prompt == "The capital of France is"
    assert text_out.prompt_token_ids == ids
    assert text_out.outputs[0].token_ids == ids_out.outputs[0].token_ids
    assert text_out.outputs[0].text == llm.get_tokenizer().decode(
        ids_out.outputs[0].token_ids, skip_special_tokens=True
    )
    assert_no_leak(llm)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "empty"),
        ({"prompt_token_ids": list(range(3, 300))}, SamplingParams(), "max_model_len=256"),
        ({"prompt_token_ids": [5, 100000]}, SamplingParams(), "Token id 100000 is out of range"),
        ({"prompt_token_ids": [5, 7, -3, 9, -4]}, SamplingParams(), "Token id -3 is out of range"),
    ],
)
def test_bad_prompts_raise_and_engine_keeps_serving(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, params, use_tqdm=False)
    assert_no_leak(llm)
    out = llm.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_bad_batch_is_rejected_whole(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine prompt", ""], SamplingParams(max_tokens=3), use_tqdm=False)
    assert_no_leak(llm)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "no-such-model"))


def test_n_greater_than_one_and_seeds(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    first = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert len(first.outputs) == 3 and [o.index for o in first.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1, "the n samples should differ"
    # The same seed reproduces, even with other (unseeded) requests in the batch.
    again = llm.generate(
        ["Once upon a time", "noise", "more noise"],
        [
            params,
            SamplingParams(temperature=1.0, max_tokens=12),
            SamplingParams(temperature=0.7, max_tokens=5),
        ],
        use_tqdm=False,
    )[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]
    assert_no_leak(llm)


def test_stop_string_cuts_text_exactly(llm):
    base = llm.generate(
        "The quick brown", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    out = llm.generate(
        "The quick brown",
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == base.text[: base.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert_no_leak(llm)


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate(
        "Rivers flow", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    stop_id = base.token_ids[4]
    first_at = base.token_ids.index(stop_id)
    out = llm.generate(
        "Rivers flow",
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == base.token_ids[: first_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_abort_frees_blocks(tiny_qwen3_path):
    engine = LLMEngine.from_engine_args(
        __import__("kvllm").EngineArgs(
            model=str(tiny_qwen3_path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 22
        )
    )
    for i in range(5):
        engine.add_request(
            f"r{i}",
            {"prompt_token_ids": list(range(3, 60 + i))},
            SamplingParams(max_tokens=50, ignore_eos=True),
        )
    engine.step()
    engine.step()
    assert engine.stats().num_free_blocks < engine.stats().num_blocks
    engine.abort_request(["r0", "r3"])
    engine.abort_request("unknown-id")
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in ("r0", "r3")
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


@pytest.mark.parametrize("budget", [None, 16])
def test_prompt_logprobs_match_hf(tiny_qwen3_path, budget):
    """Prompt logprobs equal HF's log-softmax over the prompt, whole or chunked, cached prefix or not."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"max_num_batched_tokens": budget} if budget else {}
    llm = LLM(
        str(tiny_qwen3_path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 22, **kwargs
    )
    prompt = list(range(5, 45))
    # A first request caches the prefix; the prompt-logprobs request must still score every token.
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False
    )[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_path), dtype=torch.float32)
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        token = prompt[position]
        assert entry[token].logprob == pytest.approx(float(ref[position - 1, token]), abs=1e-3)
        assert entry[token].rank == int((ref[position - 1] > ref[position - 1, token]).sum()) + 1
        assert set(ref[position - 1].topk(3).indices.tolist()) <= set(entry)
    assert_no_leak(llm)


def test_generation_config_sampling_defaults(tmp_path, tiny_qwen3_path):
    """As in vLLM: the model's generation_config.json sets sampling defaults; `vllm` ignores them."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3_path, model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update({"temperature": 0.0, "top_k": 20, "max_new_tokens": 5, "do_sample": True})
    (model / "generation_config.json").write_text(json.dumps(config))

    llm = LLM(str(model), dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 22)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 20, 5)
    out = llm.generate("Once upon a time", use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 5
    again = llm.generate("Once upon a time", use_tqdm=False)[0].outputs[0]
    assert again.token_ids == out.token_ids  # temperature 0 from the file: greedy

    plain = LLM(
        str(model),
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=1 << 22,
        generation_config="vllm",
    )
    assert plain.get_default_sampling_params().temperature == 1.0
    with pytest.raises(ValueError, match="generation_config"):
        LLM(str(model), generation_config="nonsense")


# 8 blocks of 16 tokens (2 layers x K,V x 2 heads x 32 x float32 = 16 KiB a block): 128 tokens.
EIGHT_BLOCKS = 8 * 16 * 2 * 2 * 2 * 32 * 4


def test_start_up_refuses_a_kv_cache_smaller_than_one_request(tiny_qwen3_path):
    with pytest.raises(ValueError) as info:
        LLM(str(tiny_qwen3_path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=EIGHT_BLOCKS)
    message = str(info.value)
    assert "holds 128 tokens (8 blocks of 16)" in message and "max_model_len=256" in message
    assert f"kv_cache_memory_bytes of at least {2 * EIGHT_BLOCKS}" in message
    assert "gpu_memory_utilization" in message and "max_model_len to at most 128" in message
    # The same cache with a max_model_len it can hold is accepted.
    LLM(str(tiny_qwen3_path), dtype="float32", max_model_len=128, kv_cache_memory_bytes=EIGHT_BLOCKS)


def test_a_request_that_can_never_fit_fails_and_the_engine_moves_on(tiny_qwen3_path, monkeypatch):
    """With the start-up check bypassed: the request outgrowing the cache ends with "error"."""
    import kvllm.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "_check_kv_cache_holds_one_request", lambda *args: None)
    engine = LLMEngine.from_engine_args(
        __import__("kvllm").EngineArgs(
            model=str(tiny_qwen3_path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=EIGHT_BLOCKS
        )
    )
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine.add_request("big", {"prompt_token_ids": list(range(3, 103))}, params)
    engine.add_request("next", {"prompt_token_ids": list(range(3, 13))}, params.replace(max_tokens=4))
    finished = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        finished.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert set(finished) == {"big", "next"}, "the engine livelocked"
    assert finished["big"].finish_reason == "error" and "can never run" in finished["big"].stop_reason
    assert len(finished["big"].token_ids) == 128 - 100 + 1  # the 129th token has no room in the cache
    assert finished["next"].finish_reason == "length"
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
