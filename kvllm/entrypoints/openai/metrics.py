"""Serving metrics: vLLM v1's Prometheus series (names, labels, histogram buckets) and a periodic log line.

The series are vLLM 0.22's, `vllm:` prefix and all, so vLLM's Grafana dashboard, alerts and
autoscalers read kvllm unchanged; the `kvllm:` prefix of earlier versions is gone. Every
series is labelled `model_name` (the first served name) and `engine` ("0": one engine per server),
as vLLM labels them; `vllm:cache_config_info` carries vLLM's CacheConfig field names instead.
`NOT_EXPORTED` lists vLLM's series that kvllm does not export, each with the reason; the series of
vLLM features kvllm lacks but whose true value is zero (KV-connector and multi-modal caches, deferred
waiting requests) are exported, at zero, as vLLM exports them when those features are off. vLLM's
spec-decoding (`vllm:spec_decode_*`) and KV-connector series are declared outside its v1/metrics and
exist only with --speculative-config / --kv-transfer-config; kvllm exports the spec-decoding ones
(drafts, draft tokens, accepted tokens, accepted tokens per position) when speculation is on.

Counting follows vLLM's stats (vllm/v1/metrics/stats.py): a request's prompt tokens count when its
first token arrives; the intervals come from RequestOutput.metrics' stamps: queue = queued -> first
scheduled, prefill = first scheduled -> first token, decode = first token -> last token, inference =
first scheduled -> last token, time per output token = decode / (tokens - 1). An interval is observed
only when the request reached both its ends (vLLM computes it from a zero timestamp). One deliberate
difference, for n > 1 only: vLLM counts each of the n sequences as a request, kvllm the user's
request once (its prompt once, as the response's usage does; its tokens summed over the sequences;
its intervals from the earliest first token to the latest last token), except `vllm:request_success`,
which counts sequences as vLLM does.

`StatsCollector` is the AsyncLLM's stat recorder: it turns the outputs delivered in one engine step
into an `IterationStats` once and hands it to every stat logger. It sees only delivered outputs, so a
FINAL_ONLY request (one output) adds no inter-token latencies; the server streams cumulative outputs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvllm.engine.llm_engine import EngineStats, LLMEngine
from kvllm.engine.metrics_reader import build_1_2_5_buckets
from kvllm.logger import init_logger
from kvllm.outputs import PoolingRequestOutput, RequestOutput
from kvllm.spec_decode.coordinator import SpecDecodeCounts

logger = init_logger(__name__)

# vLLM's series that kvllm does not export. Each is conditional in vLLM too, on a feature kvllm lacks;
# tests/unit/test_vllm_metrics_compat.py checks that this and the exported series cover vLLM's list.
NOT_EXPORTED: dict[str, str] = {
    "vllm:corrupted_requests": "vLLM's only with VLLM_COMPUTE_NANS_IN_LOGITS=1; kvllm does not check logits for NaNs",
    "vllm:kv_block_lifetime_seconds": "vLLM's only with --kv-cache-metrics; kvllm samples no KV block residency",
    "vllm:kv_block_idle_before_evict_seconds": "vLLM's only with --kv-cache-metrics (as kv_block_lifetime)",
    "vllm:kv_block_reuse_gap_seconds": "vLLM's only with --kv-cache-metrics (as kv_block_lifetime)",
    "vllm:lora_requests_info": "vLLM's only with --enable-lora; kvllm serves no LoRA adapters",
    "vllm:estimated_flops_per_gpu_total": "vLLM's only with --enable-mfu-metrics; kvllm estimates no FLOPs",
    "vllm:estimated_read_bytes_per_gpu_total": "vLLM's only with --enable-mfu-metrics (as estimated_flops)",
    "vllm:estimated_write_bytes_per_gpu_total": "vLLM's only with --enable-mfu-metrics (as estimated_flops)",
}

FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason strings, kvllm's too
WAITING_REASONS = ("capacity", "deferred")  # kvllm defers nothing: every waiting request waits for capacity
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")

# vLLM's bucket bounds (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (  # inter-token latency and time per output token
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (  # e2e, queue, prefill, decode and inference time
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_PARAM_BUCKETS = (1, 2, 5, 10, 20)


def cache_config_info(engine: LLMEngine) -> dict[str, str]:
    """The labels of vllm:cache_config_info: vLLM's CacheConfig fields, in its order, valued for this
    engine (str() of the value, as vLLM's metrics_info; fields of features kvllm lacks hold vLLM's
    value for "off")."""
    args = engine.args
    values: dict[str, object] = {
        "block_size": engine.block_size,
        "user_specified_block_size": args.block_size is not None,
        "user_specified_mamba_block_size": False,
        "hash_block_size": None,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "cache_dtype": args.kv_cache_dtype,
        "is_attention_free": False,
        "num_gpu_blocks_override": None,
        "sliding_window": engine.model_config.sliding_window,
        "enable_prefix_caching": args.enable_prefix_caching,
        # None of vLLM's algorithms: kvllm chains Python's hash over token tuples and compares tokens on a hit.
        "prefix_caching_hash_algo": "builtin",
        "calculate_kv_scales": False,
        "kv_cache_dtype_skip_layers": [],
        "mamba_page_size_padded": None,
        "mamba_block_size": None,
        "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "num_gpu_blocks": engine.kv_cache_manager.num_blocks,  # the KV blocks, on whatever device
        "num_cpu_blocks": None,
        "kv_sharing_fast_prefill": False,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "kv_offloading_size": None,
        "kv_offloading_backend": "native",
        "_block_size_resolved": True,  # vLLM's validator guard, an instance attribute its metrics_info reads
    }
    return {key: str(value) for key, value in values.items()}


@dataclasses.dataclass
class FinishedRequestStats:
    """What one finished request adds to the per-request histograms; None where it has no value
    (an interval whose ends it did not reach, counts of a request the engine never reported on)."""

    e2e_latency: float | None = None
    queued_time: float | None = None
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    mean_time_per_output_token: float | None = None
    num_prompt_tokens: int | None = None
    num_prefill_computed_tokens: int | None = None  # prompt tokens not found in the prefix cache
    num_generation_tokens: int | None = None
    max_num_generation_tokens: int | None = None
    max_tokens_param: int | None = None
    n_param: int | None = None

    @classmethod
    def from_output(cls, output: RequestOutput, now: float) -> FinishedRequestStats:
        m = output.metrics
        stats = cls()
        if "arrival_time" in m:
            stats.e2e_latency = now - m["arrival_time"]
        queued, scheduled = m.get("queued_time"), m.get("first_scheduled_time")
        first, last = m.get("first_token_time"), m.get("last_token_time")
        if queued is not None and scheduled is not None:
            stats.queued_time = scheduled - queued
        if scheduled is not None and first is not None:
            stats.prefill_time = first - scheduled
        if scheduled is not None and last is not None:
            stats.inference_time = last - scheduled
        if first is not None and last is not None:
            stats.decode_time = last - first
            longest = int(m.get("max_num_generation_tokens", 0))
            # The first token comes from the prefill, so it is not a decode step.
            stats.mean_time_per_output_token = stats.decode_time / (longest - 1) if longest > 1 else 0.0
        if queued is not None:  # the engine reported on it: its counts are known
            stats.num_prompt_tokens = len(output.prompt_token_ids)
            stats.num_prefill_computed_tokens = stats.num_prompt_tokens - int(m.get("num_cached_tokens", 0))
            stats.num_generation_tokens = int(m["num_generation_tokens"])
            stats.max_num_generation_tokens = int(m["max_num_generation_tokens"])
            stats.max_tokens_param = int(m["max_tokens"])
            stats.n_param = len(output.outputs) if isinstance(output.outputs, list) else 1  # pooling: 1
        return stats


@dataclasses.dataclass
class IterationStats:
    """What happened to requests in one engine step (or one abort)."""

    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # of num_prompt_tokens, found in the prefix cache
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = dataclasses.field(default_factory=list)
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)
    finished_reasons: list[str] = dataclasses.field(default_factory=list)  # one per finished sequence
    finished_requests: list[FinishedRequestStats] = dataclasses.field(default_factory=list)


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
            if isinstance(output, PoolingRequestOutput):  # one prefill, no generated tokens
                it.num_prompt_tokens += len(output.prompt_token_ids)
                it.num_cached_prompt_tokens += output.num_cached_tokens
                it.finished_reasons.append("stop")
                it.finished_requests.append(FinishedRequestStats.from_output(output, now))
                continue
            m = output.metrics
            tracked = self._requests.setdefault(output.request_id, _Tracked())
            # The engine's count is cumulative whatever the output kind; an output without it is cumulative.
            generated = int(m.get("num_generation_tokens", output.num_output_tokens))
            if generated > tracked.num_generated:
                token_time = m.get("last_token_time", now)
                if tracked.num_generated == 0:  # its first tokens: the prompt is done
                    it.num_prompt_tokens += len(output.prompt_token_ids)
                    it.num_cached_prompt_tokens += int(m.get("num_cached_tokens", 0))
                    if "arrival_time" in m:
                        it.time_to_first_tokens.append(m.get("first_token_time", now) - m["arrival_time"])
                elif tracked.last_token_time is not None:
                    it.inter_token_latencies.append(token_time - tracked.last_token_time)
                it.num_generation_tokens += generated - tracked.num_generated
                tracked.num_generated = generated
                tracked.last_token_time = token_time
            if output.finished:
                del self._requests[output.request_id]
                it.finished_reasons.extend(c.finish_reason or "abort" for c in output.outputs)
                it.finished_requests.append(FinishedRequestStats.from_output(output, now))
        for stat_logger in self.loggers:
            stat_logger.log(it, stats)


class PrometheusStatLogger:
    """vLLM's series in their own registry (several apps can live in one process)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        max_model_len: int,
        cache_config: Mapping[str, str],
        engine_index: int = 0,
    ) -> None:
        self.registry = registry
        labelnames = ["model_name", "engine"]
        labelvalues = [model_name, str(engine_index)]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames, registry=registry).labels(*labelvalues)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labelnames, registry=registry).labels(*labelvalues)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, labelnames, registry=registry, buckets=buckets).labels(*labelvalues)

        def by(metric: type[Gauge] | type[Counter], name: str, doc: str, label: str, keys: Sequence[str]):
            family = metric(name, doc, [*labelnames, label], registry=registry)
            return {
                key: family.labels(*labelvalues, key) for key in keys
            }  # every key exported from the start

        # Scheduler state.
        self.running = gauge("vllm:num_requests_running", "Number of requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be scheduled.")
        self.waiting_by_reason = by(
            Gauge,
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests by reason: capacity (waiting for room in the batch) or deferred.",
            "reason",
            WAITING_REASONS,
        )
        self.sleep_state = by(
            Gauge,
            "vllm:engine_sleep_state",
            "Engine sleep state: awake, weights_offloaded (sleep level 1), discard_all (sleep level 2).",
            "sleep_state",
            SLEEP_STATES,
        )
        self.record_sleep_state(sleeping=False)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # kvllm has no KV connector and serves text only: these stay at zero, as in vLLM without them.
        counter("vllm:external_prefix_cache_queries", "Prompt tokens looked up through a KV connector.")
        counter("vllm:external_prefix_cache_hits", "Prompt tokens found through a KV connector.")
        counter("vllm:mm_cache_queries", "Multi-modal cache queries, in items.")
        counter("vllm:mm_cache_hits", "Multi-modal cache hits, in items.")
        # Counters.
        self.preemptions = counter("vllm:num_preemptions", "Number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prompt tokens processed.")
        self.prompt_tokens_by_source = by(
            Counter,
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by source: computed, found in the prefix cache, or transferred.",
            "source",
            PROMPT_TOKEN_SOURCES,
        )
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Prompt tokens not computed (found in a cache)."
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generated tokens.")
        self._success_family = Counter(
            "vllm:request_success",
            "Number of finished sequences, by finish reason.",
            [*labelnames, "finished_reason"],
            registry=registry,
        )
        self._labelvalues = labelvalues
        for reason in FINISH_REASONS:
            self._success(reason)  # exported at zero from the start, so rates exist
        # Histograms of counts.
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", token_buckets
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Tokens (prompt and generated) per engine step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.request_max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Generated tokens of a request's longest sequence.",
            token_buckets,
        )
        self.request_n = histogram("vllm:request_params_n", "The n request parameter.", N_PARAM_BUCKETS)
        self.request_max_tokens = histogram(
            "vllm:request_params_max_tokens", "The max_tokens request parameter.", token_buckets
        )
        self.request_prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens computed per request (not found in the prefix cache).",
            token_buckets,
        )
        # Histograms of intervals.
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between generated tokens.", TOKEN_LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Decode time per generated token after the first, per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Time waiting before first scheduled.", REQUEST_LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Time running: first scheduled to last token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Time in prefill: first scheduled to first token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Time in decode: first token to last token.",
            REQUEST_LATENCY_BUCKETS,
        )
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the KV-cache configuration.",
            [*cache_config, "engine"],
            registry=registry,
        )
        info.labels(*cache_config.values(), str(engine_index)).set(1)
        self._last_engine = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)
        self._spec: tuple[list[Counter], list[Counter]] | None = None

    @classmethod
    def for_engine(
        cls, registry: CollectorRegistry, model_name: str, engine: LLMEngine
    ) -> PrometheusStatLogger:
        return cls(registry, model_name, engine.model_config.max_model_len, cache_config_info(engine))

    def record_sleep_state(self, sleeping: bool, level: int = 0) -> None:
        """Set vllm:engine_sleep_state (level 1 offloads the weights, level 2 discards them), as vLLM."""
        self.sleep_state["awake"].set(0 if sleeping else 1)
        self.sleep_state["weights_offloaded"].set(1 if sleeping and level == 1 else 0)
        self.sleep_state["discard_all"].set(1 if sleeping and level == 2 else 0)

    def log(self, it: IterationStats, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.waiting_by_reason["capacity"].set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        # The engine's counters are cumulative; Prometheus counters only go up, so add the increase.
        last = self._last_engine
        self.prefix_queries.inc(max(0, stats.prefix_cache_queries - last.prefix_cache_queries))
        self.prefix_hits.inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
        self.preemptions.inc(max(0, stats.num_preemptions - last.num_preemptions))
        if stats.spec_decoding is not None:
            self._log_spec_decoding(stats.spec_decoding, last.spec_decoding)
        self._last_engine = stats
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.prompt_tokens_by_source["local_compute"].inc(it.num_prompt_tokens - it.num_cached_prompt_tokens)
        self.prompt_tokens_by_source["local_cache_hit"].inc(it.num_cached_prompt_tokens)
        self.prompt_tokens_cached.inc(it.num_cached_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        step_tokens = it.num_prompt_tokens + it.num_generation_tokens
        if step_tokens:  # idle ticks and aborts are no engine step
            self.iteration_tokens.observe(step_tokens)
        for value in it.time_to_first_tokens:
            self.ttft.observe(value)
        for value in it.inter_token_latencies:
            self.itl.observe(value)
        for reason in it.finished_reasons:
            self._success(reason).inc()  # a reason outside FINISH_REASONS gets its own series
        for finished in it.finished_requests:
            self._observe_finished(finished)

    def _log_spec_decoding(self, now: SpecDecodeCounts, last: SpecDecodeCounts | None) -> None:
        """vLLM's spec-decoding counters, created with the first step that has them."""
        if self._spec is None:
            labels = ["model_name", "engine"]
            names = (
                ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
            )
            counters = [
                Counter(n, d, labels, registry=self.registry).labels(*self._labelvalues) for n, d in names
            ]
            per_pos = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                [*labels, "position"],
                registry=self.registry,
            )
            positions = [
                per_pos.labels(*self._labelvalues, str(j))
                for j in range(len(now.num_accepted_tokens_per_pos))
            ]
            self._spec = (counters, positions)
        counters, positions = self._spec
        before = last or SpecDecodeCounts(0, 0, 0, (0,) * len(positions))
        for counter, a, b in zip(
            counters,
            (now.num_drafts, now.num_draft_tokens, now.num_accepted_tokens),
            (before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens),
        ):
            counter.inc(max(0, a - b))
        for counter, a, b in zip(
            positions, now.num_accepted_tokens_per_pos, before.num_accepted_tokens_per_pos
        ):
            counter.inc(max(0, a - b))

    def _success(self, reason: str) -> Counter:
        return self._success_family.labels(*self._labelvalues, reason)

    def _observe_finished(self, finished: FinishedRequestStats) -> None:
        observations = (
            (self.e2e, finished.e2e_latency),
            (self.queue_time, finished.queued_time),
            (self.prefill_time, finished.prefill_time),
            (self.decode_time, finished.decode_time),
            (self.inference_time, finished.inference_time),
            (self.tpot, finished.mean_time_per_output_token),
            (self.request_prompt_tokens, finished.num_prompt_tokens),
            (self.request_prefill_kv_computed, finished.num_prefill_computed_tokens),
            (self.request_generation_tokens, finished.num_generation_tokens),
            (self.request_max_generation_tokens, finished.max_num_generation_tokens),
            (self.request_max_tokens, finished.max_tokens_param),
            (self.request_n, finished.n_param),
        )
        for histogram, value in observations:
            if value is not None:
                histogram.observe(value)


class LoggingStatLogger:
    """The periodic INFO line: throughput, running/waiting requests, preemptions, KV usage, prefix-cache
    hit rate (vLLM's line, less its "Engine 000:" prefix)."""

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
        preemptions = stats.num_preemptions - last.num_preemptions
        line = (
            f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            + (f"Preemptions: {preemptions}, " if preemptions > 0 else "")
            + f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        )
        logger.info(line)
        self._was_idle = idle
        self._last_logged = stats
        self._reset(now)
        return line
