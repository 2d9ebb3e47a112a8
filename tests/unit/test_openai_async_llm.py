"""AsyncLLM (the server's engine loop) and the stat loggers, without HTTP."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvllm.config.engine import EngineArgs
from kvllm.engine.async_llm import AsyncLLM, EngineNotAcceptingError
from kvllm.engine.llm_engine import EngineStats, LLMEngine
from kvllm.entrypoints.openai.metrics import LoggingStatLogger, StatsCollector
from kvllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama_path) -> LLMEngine:
    args = EngineArgs(
        model=str(tiny_llama_path), dtype="float32", max_model_len=2048, kv_cache_memory_bytes=1 << 22
    )
    return LLMEngine.from_engine_args(args)


class Recorder:
    def __init__(self) -> None:
        self.finished: list[str] = []

    def record(self, outputs, stats, now) -> None:
        self.finished += [c.finish_reason for o in outputs if o.finished for c in o.outputs]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_generate_cancel_and_bad_input(engine):
    recorder = Recorder()

    async def main():
        llm = AsyncLLM(engine, [recorder])
        await llm.start()
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outs = await asyncio.gather(*[_last(llm.generate("hello there", params, f"r{i}")) for i in range(8)])
        assert {len(o.outputs[0].token_ids) for o in outs} == {6}
        assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1  # greedy: all the same

        # A consumer that leaves early aborts its request and frees its blocks.
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        async for output in llm.generate("hello", long, "early"):
            if len(output.outputs[0].token_ids) >= 2:
                break
        task = asyncio.create_task(_last(llm.generate("hello", long, "cancelled")))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        with pytest.raises(ValueError, match="out of range"):
            await llm.add_request("bad", [5, 10**6], params)
        await llm.wait_idle(5)
        await asyncio.sleep(0.1)  # the aborts are applied by the engine thread
        assert llm.num_in_flight == 0
        await llm.shutdown()

    run(main())
    assert recorder.finished == ["length"] * 8 + ["abort", "abort"]
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and not engine.has_unfinished_requests()


def test_drain_finishes_short_requests_and_aborts_long_ones(engine):
    async def main():
        llm = AsyncLLM(engine)
        await llm.start()
        short = _last(llm.generate("a", SamplingParams(max_tokens=3, ignore_eos=True), "short"))
        # 2000 steps take seconds even on a fast machine, so the 0.5 s below cannot finish it.
        long = _last(llm.generate("b", SamplingParams(max_tokens=2000, ignore_eos=True), "long"))
        tasks = [asyncio.create_task(short), asyncio.create_task(long)]
        await asyncio.sleep(0.2)
        assert await llm.drain(timeout=0.3) == 1
        short_out, long_out = await asyncio.gather(*tasks)
        assert short_out.outputs[0].finish_reason == "length"
        assert long_out.finished and long_out.outputs[0].finish_reason == "abort"
        assert 0 < len(long_out.outputs[0].token_ids) < 2000
        with pytest.raises(EngineNotAcceptingError):
            await llm.add_request("late", "c", SamplingParams())
        await llm.shutdown()

    run(main())
    assert not engine.has_unfinished_requests()


def test_a_second_asyncllm_cannot_drive_an_engine_another_one_is_driving(engine):
    """One engine thread per engine: a second AsyncLLM over the same LLMEngine is refused while the first
    runs (two threads stepping one engine corrupt it), and takes over once the first is shut down."""

    async def main():
        first, second = AsyncLLM(engine), AsyncLLM(engine)
        await first.start()
        with pytest.raises(RuntimeError, match="already driven by another running AsyncLLM"):
            await second.start()
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        out = await _last(first.generate("still serving", params, "first"))
        assert len(out.outputs[0].token_ids) == 3
        await first.shutdown()
        await second.start()
        out = await _last(second.generate("taken over", params, "second"))
        assert len(out.outputs[0].token_ids) == 3
        await second.shutdown()

    run(main())
    assert not engine.has_unfinished_requests()


def test_stats_collector_and_log_line():
    line_logger = LoggingStatLogger()
    collector = StatsCollector([line_logger])
    from kvllm.outputs import CompletionOutput, RequestOutput

    def output(num_tokens: int, finished: bool) -> RequestOutput:
        completion = CompletionOutput(
            0, "x" * num_tokens, list(range(num_tokens)), None, None, "length" if finished else None
        )
        return RequestOutput("r", "p", [1, 2, 3], [completion], finished, {"arrival_time": 0.0})

    stats = EngineStats(1, 2, 0.25, 100, 40, 0, 10, 7)
    collector.record([output(1, False)], stats, 1.0)
    collector.record([output(4, True)], stats, 2.0)
    line = line_logger.log_interval(now=line_logger._since + 2.0)
    assert line is not None
    assert "Avg prompt throughput: 1.5 tokens/s" in line and "Avg generation throughput: 2.0 tokens/s" in line
    assert "Running: 1 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 40.0%" in line


async def _last(stream):
    last = None
    async for output in stream:
        last = output
    return last


def _assert_engine_idle(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert not engine.has_unfinished_requests()
    assert stats.num_free_blocks == stats.num_blocks


def test_a_client_leaving_while_the_engine_thread_adds_its_request_is_not_fatal(engine, monkeypatch):
    """Cancelled while `engine.add_request` runs: the request is added, then aborted; the engine lives."""
    in_add, left = threading.Event(), threading.Event()
    real_add = engine.add_request

    def add_while_the_client_leaves(request_id, *args, **kwargs):
        if request_id == "leaver":
            in_add.set()
            assert left.wait(30), "the test never cancelled the client"
        return real_add(request_id, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", add_while_the_client_leaves)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main():
        llm = AsyncLLM(engine)
        await llm.start()
        client = asyncio.create_task(llm.add_request("leaver", "hello", params))
        assert await asyncio.to_thread(in_add.wait, 30)
        client.cancel()
        with pytest.raises(asyncio.CancelledError):
            await client
        left.set()
        after = await _last(llm.generate("hello", params, "after"))
        assert after.outputs[0].finish_reason == "length"
        assert not llm.errored
        await llm.wait_idle(10)
        await llm.shutdown()

    run(main())
    _assert_engine_idle(engine)


def test_a_client_leaving_before_the_engine_thread_takes_its_request_is_not_fatal(engine, monkeypatch):
    """Cancelled while its add waits in the command queue (the engine thread is mid-step)."""
    in_step, release = threading.Event(), threading.Event()
    real_step = engine.step

    def step_held_once():
        if not in_step.is_set():
            in_step.set()
            assert release.wait(30), "the test never released the step"
        return real_step()

    monkeypatch.setattr(engine, "step", step_held_once)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main():
        llm = AsyncLLM(engine)
        await llm.start()
        first = asyncio.create_task(_last(llm.generate("first", params, "first")))
        assert await asyncio.to_thread(in_step.wait, 30)
        client = asyncio.create_task(llm.add_request("leaver", "hello", params))
        await asyncio.sleep(0)  # the add command is queued
        client.cancel()
        with pytest.raises(asyncio.CancelledError):
            await client
        release.set()
        assert (await first).outputs[0].finish_reason == "length"
        after = await _last(llm.generate("hello", params, "after"))
        assert after.outputs[0].finish_reason == "length" and not llm.errored
        await llm.wait_idle(10)
        await llm.shutdown()

    run(main())
    _assert_engine_idle(engine)
