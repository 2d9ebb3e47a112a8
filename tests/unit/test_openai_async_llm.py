"""AsyncLLM (the server's engine loop) and the stat loggers, without HTTP."""

from __future__ import annotations

import asyncio

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
