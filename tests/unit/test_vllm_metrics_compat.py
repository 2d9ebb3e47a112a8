"""/metrics speaks vLLM 0.22: its series names, labels and buckets, and values that mean what vLLM's mean.

vLLM's list is tests/data/vllm_0_22_metrics.json (extracted from vLLM's source by
tools/extract_vllm_metrics.py); where that source is present the list is re-extracted and compared, so
it cannot go stale unnoticed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvllm.core.kv_cache_manager import KVCacheManager
from kvllm.core.request import Request
from kvllm.core.scheduler import Scheduler
from kvllm.engine.async_llm import AsyncLLM
from kvllm.engine.llm_engine import EngineStats, LLMEngine
from kvllm.entrypoints.openai.metrics import (
    NOT_EXPORTED,
    LoggingStatLogger,
    PrometheusStatLogger,
    StatsCollector,
    build_1_2_5_buckets,
    cache_config_info,
)
from kvllm.entrypoints.openai.server import build_app
from kvllm.outputs import CompletionOutput, RequestOutput
from kvllm.sampling_params import RequestOutputKind, SamplingParams
from tests.unit.test_openai_server import tiny_engine

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "vllm_0_22_metrics.json"
VLLM = json.loads(DATA.read_text())
REFERENCE = Path(os.environ.get("KVLLM_VLLM_SOURCE", "/work/ref/vllm-0.22/site-vllm/vllm"))
MAX_MODEL_LEN = 256
LABELS = {"model_name": "m", "engine": "0"}


def _tool():
    spec = importlib.util.spec_from_file_location(
        "extract_vllm_metrics", ROOT / "tools" / "extract_vllm_metrics.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engine(tiny_qwen3_path) -> LLMEngine:
    return tiny_engine(tiny_qwen3_path, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def scraped(engine) -> dict[str, object]:
    """/metrics after one completion, parsed: {family name: family}."""
    app = build_app(engine=engine, served_model_name="m", log_stats_interval=0)
    with TestClient(app) as client:
        out = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert out.status_code == 200
        text = client.get("/metrics").text
    families = text_string_to_metric_families(text)
    # prometheus_client's `x_created` timestamps parse as families of their own; vLLM has them alike.
    return {f.name: f for f in families if not (f.name.endswith("_created") and f.type == "gauge")}


# ---- the list ---------------------------------------------------------------------------------


@pytest.mark.skipif(not REFERENCE.is_dir(), reason=f"vLLM's source is not at {REFERENCE} (KVLLM_VLLM_SOURCE)")
def test_the_committed_list_is_what_vllms_source_declares():
    tool = _tool()
    assert tool.render(tool.extract(REFERENCE)) == DATA.read_text(), (
        "tests/data/vllm_0_22_metrics.json is stale: python tools/extract_vllm_metrics.py --source "
        + str(REFERENCE)
    )


def test_every_vllm_series_is_exported_or_allow_listed_with_a_reason(scraped):
    vllm = set(VLLM["names"])
    # A counter family is named without the `_total` of its samples, as vLLM declares its counters.
    exported = {f.name for f in scraped.values() if f.name.startswith(("vllm:", "kvllm:"))}
    assert not {n for n in exported if n.startswith("kvllm:")}, "the kvllm: prefix is gone"
    assert exported - vllm == set(), "series vLLM does not have"
    assert vllm - exported == set(NOT_EXPORTED), "vLLM series neither exported nor in NOT_EXPORTED"
    assert all(len(reason) > 20 for reason in NOT_EXPORTED.values())


def test_labels_are_vllms(scraped, engine):
    for name, family in scraped.items():
        if not name.startswith("vllm:"):
            continue
        expected = VLLM["labelnames"].get(name)
        if name == "vllm:cache_config_info":
            expected = VLLM["cache_config_info_labels"]
        assert expected is not None, f"{name}: no vLLM label names to compare with"
        for sample in family.samples:
            labels = set(sample.labels) - {"le"}  # histogram buckets add `le`
            assert labels == set(expected), name
            if name != "vllm:cache_config_info":
                assert sample.labels["model_name"] == "m" and sample.labels["engine"] == "0"
    info = scraped["vllm:cache_config_info"].samples[0]
    assert list(cache_config_info(engine)) == VLLM["cache_config_info_labels"][:-1]  # vLLM's order too
    assert info.value == 1 and info.labels["engine"] == "0"
    assert info.labels["block_size"] == str(engine.block_size)
    assert info.labels["num_gpu_blocks"] == str(engine.kv_cache_manager.num_blocks)
    assert info.labels["enable_prefix_caching"] == "True"


def test_histogram_buckets_are_vllms(scraped):
    expected_buckets = VLLM["histogram_buckets"]
    histograms = [f for f in scraped.values() if f.type == "histogram" and f.name.startswith("vllm:")]
    assert len(histograms) == 15
    for family in histograms:
        expected = expected_buckets[family.name]
        if expected == "1-2-5 up to max_model_len":
            expected = build_1_2_5_buckets(MAX_MODEL_LEN)
        bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
        assert bounds == [float(b) for b in expected] + [float("inf")], family.name


def test_1_2_5_buckets_stop_at_the_maximum():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(256) == [1, 2, 5, 10, 20, 50, 100, 200]
    assert build_1_2_5_buckets(1) == [1]


def test_finish_reasons_and_idle_features_are_exported_at_zero(scraped):
    success = {s.labels["finished_reason"]: s.value for s in scraped["vllm:request_success"].samples}
    assert success == {"stop": 0, "length": 1, "abort": 0, "error": 0}
    for name in ("vllm:external_prefix_cache_queries", "vllm:mm_cache_hits"):
        assert [s.value for s in scraped[name].samples if s.name.endswith("_total")] == [0]
    sleep = {s.labels["sleep_state"]: s.value for s in scraped["vllm:engine_sleep_state"].samples}
    assert sleep == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}


# ---- the values -------------------------------------------------------------------------------


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {**LABELS, **labels})
    assert value is not None, name
    return value


def _drive(
    engine: LLMEngine, requests: list[tuple[object, SamplingParams]]
) -> tuple[CollectorRegistry, list]:
    """Run the requests through an AsyncLLM whose stats go to a fresh registry; their final outputs."""
    registry = CollectorRegistry()
    prometheus = PrometheusStatLogger.for_engine(registry, "m", engine)

    async def main():
        llm = AsyncLLM(engine, [StatsCollector([prometheus])])
        await llm.start()
        finals = []
        for i, (prompt, params) in enumerate(requests):  # one after another: the values are per request
            async for output in llm.generate(prompt, params, f"r{i}"):
                last = output
            finals.append(last)
        await llm.shutdown()
        return finals

    return registry, asyncio.run(asyncio.wait_for(main(), 60))


def test_request_histograms_observe_vllms_intervals_and_counts(engine):
    prompt = list(range(1, 21))
    registry, [out] = _drive(engine, [(prompt, SamplingParams(max_tokens=5, ignore_eos=True))])
    m = out.metrics
    assert m["arrival_time"] <= m["queued_time"] <= m["first_scheduled_time"]
    assert m["first_scheduled_time"] <= m["first_token_time"] <= m["last_token_time"]

    def total(name: str) -> float:
        assert _value(registry, f"{name}_count") == 1, name
        return _value(registry, f"{name}_sum")

    queue = total("vllm:request_queue_time_seconds")
    prefill = total("vllm:request_prefill_time_seconds")
    decode = total("vllm:request_decode_time_seconds")
    inference = total("vllm:request_inference_time_seconds")
    assert queue == pytest.approx(m["first_scheduled_time"] - m["queued_time"]) and queue >= 0
    assert prefill == pytest.approx(m["first_token_time"] - m["first_scheduled_time"])
    assert inference == pytest.approx(m["last_token_time"] - m["first_scheduled_time"])
    assert prefill + decode == pytest.approx(inference)
    assert decode > 0  # 5 tokens come from 5 steps
    assert total("vllm:e2e_request_latency_seconds") >= inference + queue
    assert total("vllm:time_to_first_token_seconds") >= queue + prefill
    # Four decode steps: their inter-token latencies add up to the decode time.
    assert _value(registry, "vllm:inter_token_latency_seconds_count") == 4
    assert _value(registry, "vllm:inter_token_latency_seconds_sum") == pytest.approx(decode)
    assert total("vllm:request_time_per_output_token_seconds") == pytest.approx(decode / 4)
    # Per-request counts equal the output.
    assert total("vllm:request_prompt_tokens") == len(out.prompt_token_ids) == 20
    assert total("vllm:request_prefill_kv_computed_tokens") == 20  # nothing cached yet
    assert total("vllm:request_generation_tokens") == len(out.outputs[0].token_ids) == 5
    assert total("vllm:request_max_num_generation_tokens") == 5
    assert total("vllm:request_params_max_tokens") == 5
    assert total("vllm:request_params_n") == 1
    assert _value(registry, "vllm:prompt_tokens_total") == 20
    assert _value(registry, "vllm:generation_tokens_total") == 5
    assert _value(registry, "vllm:iteration_tokens_total_sum") == 25
    assert _value(registry, "vllm:request_success_total", finished_reason="length") == 1


def test_n_sequences_are_one_request_and_n_successes(engine):
    params = SamplingParams(n=2, max_tokens=4, ignore_eos=True, temperature=1.0, seed=1)
    registry, [out] = _drive(engine, [("hello there", params)])
    assert [len(c.token_ids) for c in out.outputs] == [4, 4]
    assert _value(registry, "vllm:request_success_total", finished_reason="length") == 2
    assert _value(registry, "vllm:e2e_request_latency_seconds_count") == 1
    assert (
        _value(registry, "vllm:request_generation_tokens_sum")
        == 8
        == _value(registry, "vllm:generation_tokens_total")
    )
    assert _value(registry, "vllm:request_max_num_generation_tokens_sum") == 4
    assert _value(registry, "vllm:request_params_n_sum") == 2
    assert _value(registry, "vllm:prompt_tokens_total") == len(out.prompt_token_ids)  # once, as in usage


def test_delta_outputs_count_the_same_tokens(engine):
    params = SamplingParams(max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    registry, [out] = _drive(engine, [("hello there", params)])
    assert len(out.outputs[0].token_ids) < 6  # the last delta only
    assert _value(registry, "vllm:generation_tokens_total") == 6
    assert _value(registry, "vllm:request_generation_tokens_sum") == 6
    assert _value(registry, "vllm:inter_token_latency_seconds_count") == 5


def test_prefix_cache_hits_split_the_prompt_tokens_by_source(engine):
    prompt = list(range(30, 70))  # 40 tokens: two full blocks of 16 can be found again
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    registry, [first, second] = _drive(engine, [(prompt, params), (prompt, params)])
    cached = second.metrics["num_cached_tokens"]
    assert first.metrics["num_cached_tokens"] == 0 and cached == 2 * engine.block_size
    assert _value(registry, "vllm:prompt_tokens_cached_total") == cached
    assert _value(registry, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == cached
    assert _value(registry, "vllm:prompt_tokens_by_source_total", source="local_compute") == 80 - cached
    assert _value(registry, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert _value(registry, "vllm:request_prefill_kv_computed_tokens_sum") == 80 - cached
    assert _value(registry, "vllm:prefix_cache_hits_total") == cached


def test_a_request_aborted_before_any_output_counts_its_latency_only():
    registry = CollectorRegistry()
    prometheus = PrometheusStatLogger(registry, "m", MAX_MODEL_LEN, {"block_size": "16"})
    collector = StatsCollector([prometheus])
    aborted = RequestOutput(
        "r", None, [], [CompletionOutput(0, "", [], None, None, "abort")], True, {"arrival_time": 1.0}
    )
    collector.record([aborted], EngineStats(0, 0, 0.0, 0, 0, 0, 8, 8), now=3.5)
    assert _value(registry, "vllm:request_success_total", finished_reason="abort") == 1
    assert _value(registry, "vllm:e2e_request_latency_seconds_sum") == 2.5
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prompt_tokens", "vllm:request_params_n"):
        assert _value(registry, f"{name}_count") == 0, name  # unknown, not zero
    assert _value(registry, "vllm:iteration_tokens_total_count") == 0  # an abort is no engine step


def test_an_unknown_finish_reason_is_counted_not_dropped():
    registry = CollectorRegistry()
    collector = StatsCollector([PrometheusStatLogger(registry, "m", MAX_MODEL_LEN, {})])
    odd = RequestOutput("r", None, [], [CompletionOutput(0, "", [], None, None, "odd")], True, {})
    collector.record([odd], EngineStats(0, 0, 0.0, 0, 0, 0, 8, 8), now=1.0)
    assert _value(registry, "vllm:request_success_total", finished_reason="odd") == 1


def test_sleep_state_levels():
    registry = CollectorRegistry()
    prometheus = PrometheusStatLogger(registry, "m", MAX_MODEL_LEN, {})

    def state() -> dict[str, float]:
        return {s: _value(registry, "vllm:engine_sleep_state", sleep_state=s) for s in prometheus.sleep_state}

    prometheus.record_sleep_state(sleeping=True, level=1)
    assert state() == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
    prometheus.record_sleep_state(sleeping=True, level=2)
    assert state() == {"awake": 0, "weights_offloaded": 0, "discard_all": 1}
    prometheus.record_sleep_state(sleeping=False)
    assert state() == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}


def test_the_first_schedule_is_kept_across_a_preemption():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = (
        Request(r, list(range(1 + o, 9 + o)), SamplingParams(), 100, (0,)) for r, o in (("a", 0), ("b", 50))
    )
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert a.queued_time is not None and a.first_scheduled_time is None
    for item in scheduler.schedule().scheduled:  # both prefill and sample a token
        item.request.resolve_placeholder()
        item.request.append_output_token(7)
    first = b.first_scheduled_time
    assert first is not None and first >= b.queued_time
    assert [r.request_id for r in scheduler.schedule().preempted] == ["b"]  # "a" needs a 3rd block
    scheduler.finish_request(a)
    assert scheduler.schedule().scheduled[0].request is b
    assert b.first_scheduled_time == first


def test_the_log_line_reports_preemptions_in_its_interval():
    line_logger = LoggingStatLogger()
    collector = StatsCollector([line_logger])
    output = RequestOutput("r", "p", [1, 2], [CompletionOutput(0, "x", [5], None, None)], False, {})
    collector.record([output], EngineStats(1, 0, 0.5, 0, 0, 3, 10, 5), 1.0)
    line = line_logger.log_interval(now=line_logger._since + 1.0)
    assert "Waiting: 0 reqs, Preemptions: 3, KV cache usage: 50.0%" in line
    collector.record([], EngineStats(1, 0, 0.5, 0, 0, 3, 10, 5), 2.0)
    assert "Preemptions" not in line_logger.log_interval(now=line_logger._since + 1.0)
