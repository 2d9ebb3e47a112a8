"""`LLM.get_metrics()`: the offline engine's metrics as vLLM's `vllm.v1.metrics.reader` objects.

vLLM's LLM reads them back from the Prometheus registry its stat loggers fill in-process. kvllm's
offline LLM has no Prometheus registry (the server's lives in the app, `entrypoints/openai/metrics.py`),
so this module builds the same objects, with vLLM's names, types and labels (`model_name`, `engine`),
from the engine's own counters (`EngineStats`) and from the finished requests `LLM` counts
(`FinishedRequestCounters`). Latency histograms (time to first token, inter-token, end to end) are
the server's only: an offline batch's timings say little per request.
"""

from __future__ import annotations

import bisect
from collections import Counter as TallyCounter
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

from kvllm.engine.llm_engine import EngineStats
from kvllm.outputs import RequestOutput

# vLLM's request_success reasons, always reported (0 until one happens), as its Prometheus logger does.
FINISHED_REASONS = ("stop", "length", "abort", "error")
# vLLM's engine_sleep_state label per sleep level.
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


@dataclass
class Metric:
    """One series: a name and its labels (vLLM's reader.Metric)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters (vllm:spec_decode_num_accepted_tokens_per_pos, by position)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: `buckets` maps each upper bound, as Prometheus prints it ("5.0",
    "+Inf"), to the cumulative count at or below it; `count` equals buckets["+Inf"]."""

    count: int
    sum: float
    buckets: dict[str, int]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass
class _Observations:
    bounds: list[int]
    counts: list[int] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)  # the last slot is above every bound

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def to_metric(self, name: str, labels: dict[str, str]) -> Histogram:
        buckets, running = {}, 0
        for bound, n in zip([*self.bounds, float("inf")], self.counts):
            running += n
            buckets[floatToGoString(bound)] = running
        return Histogram(name, dict(labels), self.count, self.total, buckets)


class FinishedRequestCounters:
    """Token and request counts of the requests an LLM finished (vLLM's per-request series)."""

    def __init__(self, max_model_len: int) -> None:
        bounds = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: TallyCounter[str] = TallyCounter()
        self.request_prompt_tokens = _Observations(bounds)
        self.request_generation_tokens = _Observations(bounds)

    def record(self, output: RequestOutput) -> None:
        """Count one finished request (every sequence of it, like the server's usage)."""
        num_prompt = len(output.prompt_token_ids)
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        self.prompt_tokens += num_prompt
        self.generation_tokens += num_generated
        self.request_prompt_tokens.observe(num_prompt)
        self.request_generation_tokens.observe(num_generated)
        for c in output.outputs:
            self.finished[c.finish_reason or "abort"] += 1


def metrics_snapshot(
    stats: EngineStats, counters: FinishedRequestCounters, model_name: str, sleep_level: int
) -> list[Metric]:
    """Every series, in vLLM's names, for one engine (label engine="0")."""
    labels = {"model_name": model_name, "engine": "0"}
    metrics: list[Metric] = [
        Gauge("vllm:num_requests_running", dict(labels), float(stats.num_running)),
        Gauge("vllm:num_requests_waiting", dict(labels), float(stats.num_waiting)),
        Gauge("vllm:kv_cache_usage_perc", dict(labels), float(stats.kv_cache_usage)),
    ]
    current = SLEEP_STATES[sleep_level]
    for state in SLEEP_STATES:
        metrics.append(
            Gauge("vllm:engine_sleep_state", {**labels, "sleep_state": state}, float(state == current))
        )
    metrics += [
        Counter("vllm:prefix_cache_queries", dict(labels), stats.prefix_cache_queries),
        Counter("vllm:prefix_cache_hits", dict(labels), stats.prefix_cache_hits),
        Counter("vllm:num_preemptions", dict(labels), stats.num_preemptions),
        Counter("vllm:prompt_tokens", dict(labels), counters.prompt_tokens),
        Counter("vllm:generation_tokens", dict(labels), counters.generation_tokens),
    ]
    reasons = list(FINISHED_REASONS) + sorted(set(counters.finished) - set(FINISHED_REASONS))
    for reason in reasons:
        metrics.append(
            Counter("vllm:request_success", {**labels, "finished_reason": reason}, counters.finished[reason])
        )
    spec = stats.spec_decoding
    if spec is not None:  # vLLM's series exist only with speculative decoding, as here
        metrics += [
            Counter("vllm:spec_decode_num_drafts", dict(labels), spec.num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", dict(labels), spec.num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", dict(labels), spec.num_accepted_tokens),
            Vector(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                dict(labels),
                list(spec.num_accepted_tokens_per_pos),
            ),
        ]
    metrics.append(counters.request_prompt_tokens.to_metric("vllm:request_prompt_tokens", labels))
    metrics.append(counters.request_generation_tokens.to_metric("vllm:request_generation_tokens", labels))
    return metrics
