"""Serving metrics: Prometheus series named like vLLM's (prefix `kvllm:`) and a periodic log line.

`StatsCollector` is the AsyncLLM's stat recorder: it turns each step's outputs into an
`IterationStats` (tokens, latencies, finished requests) once and hands it to every stat logger.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvllm.engine.llm_engine import EngineStats
from kvllm.logger import init_logger
from kvllm.outputs import RequestOutput

logger = init_logger(__name__)

# Bucket bounds in seconds (vLLM's, trimmed to the ranges a CPU or GPU server sees).
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


@dataclasses.dataclass
class IterationStats:
    """What happened to requests in one engine step (or one abort)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = dataclasses.field(default_factory=list)
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)
    finished_reasons: list[str] = dataclasses.field(default_factory=list)  # one per finished sequence
    e2e_latencies: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Tracked:
    num_generated: int = 0
    last_token_time: float | None = None


class StatsCollector:
    """Per-request bookkeeping shared by the stat loggers (an AsyncLLM StatRecorder)."""

    def __init__(self, loggers: Sequence[PrometheusStatLogger | LoggingStatLogger]) -> None:
        self.loggers = list(loggers)
        self._requests: dict[str, _Tracked] = {}

    def record(self, outputs: Sequence[RequestOutput], stats: EngineStats, now: float) -> None:
        it = IterationStats()
        for output in outputs:
            tracked = self._requests.get(output.request_id)
            if tracked is None:
                tracked = self._requests[output.request_id] = _Tracked()
                # Counted once per request (not per sequence), as in the response's usage.
                it.num_prompt_tokens += len(output.prompt_token_ids)
                first = output.metrics.get("first_token_time")
                if first is not None and "arrival_time" in output.metrics:
                    it.time_to_first_tokens.append(first - output.metrics["arrival_time"])
            generated = output.num_output_tokens
            if generated > tracked.num_generated:
                if tracked.last_token_time is not None:
                    it.inter_token_latencies.append(now - tracked.last_token_time)
                it.num_generation_tokens += generated - tracked.num_generated
                tracked.num_generated = generated
                tracked.last_token_time = now
            if output.finished:
                del self._requests[output.request_id]
                it.finished_reasons.extend(c.finish_reason or "abort" for c in output.outputs)
                if "arrival_time" in output.metrics:
                    it.e2e_latencies.append(now - output.metrics["arrival_time"])
        for stat_logger in self.loggers:
            stat_logger.log(it, stats)


class PrometheusStatLogger:
    """Prometheus series in their own registry (several apps can live in one process)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kvllm:{name}", doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvllm:{name}", doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"kvllm:{name}", doc, labels, registry=registry, buckets=buckets).labels(
                model_name
            )

        self.running = gauge("num_requests_running", "Number of requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generated tokens.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Number of preemptions.")
        self._success = Counter(
            "kvllm:request_success",
            "Number of finished sequences, by finish reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self._model_name = model_name
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)  # export zeros, so rates exist from the start
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between generated tokens.", _ITL_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Request latency, arrival to finish.", _E2E_BUCKETS
        )
        self._last_engine = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)

    def log(self, it: IterationStats, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        # The engine's counters are cumulative; Prometheus counters only go up, so add the increase.
        last = self._last_engine
        self.prefix_queries.inc(max(0, stats.prefix_cache_queries - last.prefix_cache_queries))
        self.prefix_hits.inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
        self.preemptions.inc(max(0, stats.num_preemptions - last.num_preemptions))
        self._last_engine = stats
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        for value in it.time_to_first_tokens:
            self.ttft.observe(value)
        for value in it.inter_token_latencies:
            self.itl.observe(value)
        for value in it.e2e_latencies:
            self.e2e.observe(value)
        for reason in it.finished_reasons:
            self._success.labels(self._model_name, reason).inc()


class LoggingStatLogger:
    """The periodic INFO line: throughput, running/waiting requests, KV usage, prefix-cache hit rate."""

    def __init__(self) -> None:
        self._reset(time.monotonic())
        self._stats = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)
        self._last_logged = self._stats
        self._was_idle = True  # no line until the first request

    def _reset(self, now: float) -> None:
        self._since = now
        self._prompt_tokens = 0
        self._generation_tokens = 0

    def log(self, it: IterationStats, stats: EngineStats) -> None:
        self._prompt_tokens += it.num_prompt_tokens
        self._generation_tokens += it.num_generation_tokens
        self._stats = stats

    def log_interval(self, now: float | None = None) -> str | None:
        """Log (and return) the line for the time since the last call; quiet while idle after one idle line."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._since, 1e-9)
        stats, last = self._stats, self._last_logged
        idle = not (self._prompt_tokens or self._generation_tokens or stats.num_running or stats.num_waiting)
        if idle and self._was_idle:
            self._reset(now)
            return None
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        line = (
            f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        )
        logger.info(line)
        self._was_idle = idle
        self._last_logged = stats
        self._reset(now)
        return line
