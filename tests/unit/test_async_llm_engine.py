"""AsyncLLMEngine: vLLM's asyncio engine API over AsyncLLM (generate, abort, output kinds, sleep)."""

from __future__ import annotations

import asyncio

import pytest

from kvllm import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from kvllm.engine.llm_engine import EngineSleepingError
from kvllm.sampling_params import RequestOutputKind

ARGS = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory_bytes": 1 << 21}
PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_qwen3_path) -> list[int]:
    llm = LLM(str(tiny_qwen3_path), **ARGS)
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture
def engine(tiny_qwen3_path):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(tiny_qwen3_path), **ARGS))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncLLMEngine, request_id: str, params: SamplingParams = GREEDY):
    return [out async for out in engine.generate(PROMPT, params, request_id=request_id)]


def test_generate_yields_cumulative_outputs_equal_to_llm(engine, expected):
    async def run():
        outputs = await collect(engine, "r1")
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == expected
        assert all(not o.finished for o in outputs[:-1])
        # Cumulative: each output extends the one before.
        ids = [o.outputs[0].token_ids for o in outputs]
        assert all(b[: len(a)] == a for a, b in zip(ids, ids[1:]))
        assert await engine.reset_prefix_cache() is True
        await engine.check_health()
        assert engine.is_running and not engine.errored

    asyncio.run(run())


def test_delta_outputs_add_up_to_the_whole(engine, expected):
    async def run():
        params = GREEDY.replace(output_kind=RequestOutputKind.DELTA)
        outputs = []
        async for output in engine.generate(PROMPT, params, "d1"):
            outputs.append(output)
            if len(outputs) == 1:
                # Fall behind: let the request finish first, so every later delta is queued at once.
                while await engine.async_llm.call_engine(lambda e: e.has_unfinished_requests()):
                    pass
        assert len(outputs) > 2
        assert [t for o in outputs for t in o.outputs[0].token_ids] == expected
        full = await collect(engine, "c1")
        assert "".join(o.outputs[0].text for o in outputs) == full[-1].outputs[0].text

    asyncio.run(run())


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_abort_ends_the_stream_with_abort_and_frees_blocks(engine, kind):
    async def run():
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, output_kind=kind)
        seen = []
        async for output in engine.generate(PROMPT, params, "long"):
            seen.append(output)
            if len(seen) == 1:
                await engine.abort("long")
        assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
        if kind is RequestOutputKind.DELTA:
            # The final delta carries nothing new; the deltas before it are what was generated.
            assert seen[-1].outputs[0].token_ids == [] and seen[-1].outputs[0].text == ""
            assert 0 < sum(len(o.outputs[0].token_ids) for o in seen) < 100
        else:
            assert 0 < len(seen[-1].outputs[0].token_ids) < 100
        await engine.abort(["unknown-id"])  # ignored
        assert await engine.reset_prefix_cache() is True  # nothing holds blocks any more

    asyncio.run(run())


def test_sleep_and_wake_up_through_the_engine_thread(engine, expected):
    async def run():
        await engine.sleep(1)
        assert await engine.is_sleeping()
        with pytest.raises(EngineSleepingError, match="wake_up"):
            await collect(engine, "asleep")
        await engine.wake_up()
        assert not await engine.is_sleeping()
        assert (await collect(engine, "awake"))[-1].outputs[0].token_ids == expected

    asyncio.run(run())


def test_bad_arguments_and_another_event_loop_are_errors(engine, tiny_qwen3_path):
    with pytest.raises(TypeError, match="swap_everything"):
        AsyncLLMEngine.from_engine_args(
            AsyncEngineArgs(model=str(tiny_qwen3_path), **ARGS), swap_everything=1
        )

    async def run():
        with pytest.raises(ValueError, match="LoRA"):
            await collect_with(engine, lora_request=object())
        with pytest.raises(ValueError, match="priority scheduling is not enabled"):  # the engine is fcfs
            await collect_with(engine, priority=1)
        await collect(engine, "first")

    async def collect_with(engine, **kwargs):
        return [o async for o in engine.generate(PROMPT, GREEDY, "x", **kwargs)]

    asyncio.run(run())
    with pytest.raises(RuntimeError, match="another event loop"):
        asyncio.run(collect(engine, "second"))


def test_shutdown_stops_the_engine_thread(engine):
    asyncio.run(collect(engine, "one"))
    thread = engine.async_llm._thread
    assert thread is not None and thread.is_alive()
    engine.shutdown()
    assert not thread.is_alive() and not engine.is_running
