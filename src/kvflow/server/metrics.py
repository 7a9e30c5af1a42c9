"""Prometheus metrics with vLLM's names, types, labels and buckets.

Each app owns its CollectorRegistry (never the global one), so several servers can live in one
process (tests). Everything is fed from the engine loop's `IterationStats`: gauges from the
scheduler snapshot, counters from deltas of the engine's own counters (a preemption is counted
when it happens, not when some output mentions it) and from the step's outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvflow.config import EngineConfig
from kvflow.engine.async_stats import IterationStats
from kvflow.server.metrics_info import InfoMetrics, cache_config_labels, register_cache_config

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_LABELS = ["model_name", "engine"]
_FINISH_REASONS = ("stop", "length", "abort", "error")
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
_ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]  # fmt: skip
_COMPILE_BUCKETS = [0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
_REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        config: EngineConfig,
        gpu_memory_utilization: float,
        num_blocks_override: int | None = None,
        kv_cache_memory: int | None = None,
    ):
        self.registry = CollectorRegistry()
        self._values = (model_name, "0")
        gauge, counter = self._gauge, self._counter
        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting, by why they wait (capacity: blocked on KV cache "
            "blocks; deferred: waiting for their turn).",
            [*_LABELS, "reason"],
            registry=self.registry,
        )
        self.waiting_capacity = by_reason.labels(*self._values, "capacity")
        self.waiting_deferred = by_reason.labels(*self._values, "deferred")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.stuck_failed = counter(
            "kvflow:stuck_requests_failed",
            "Requests failed because they could never be scheduled (a broken invariant).",
        )
        self._structured_output_metrics()
        self._success = self._finish_reasons()
        self._histograms(config.max_model_len)
        self._vllm_032_counters()
        self._vllm_032_histograms(config.max_model_len)
        self._legacy_names()
        self.info = InfoMetrics(self.registry, _LABELS, self._values)
        register_cache_config(
            self.registry,
            cache_config_labels(
                config, gpu_memory_utilization, num_blocks_override, kv_cache_memory
            ),
        )

    def _finish_reasons(self) -> Counter:
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*_LABELS, "finished_reason"],
            registry=self.registry,
        )
        for reason in _FINISH_REASONS:
            success.labels(*self._values, reason)
        return success

    def _structured_output_metrics(self) -> None:
        self.grammar_failed = self._counter(
            "kvflow:structured_output_requests_failed",
            "Requests failed by their output constraint: it did not compile, or it allowed no "
            "next token.",
        )
        self.grammar_compile = self._histogram(
            "kvflow:structured_output_compile_seconds",
            "Per constrained request: seconds from admission until its grammar was compiled "
            "(about 0 when the same constraint was compiled before).",
            _COMPILE_BUCKETS,
        )

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, _LABELS, registry=self.registry).labels(*self._values)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, _LABELS, registry=self.registry).labels(*self._values)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        h = Histogram(name, doc, _LABELS, buckets=buckets, registry=self.registry)
        return h.labels(*self._values)

    def _histograms(self, max_model_len: int) -> None:
        self._latency_histograms()
        self._request_histograms(build_1_2_5_buckets(max_model_len))

    def _latency_histograms(self) -> None:
        histogram = self._histogram
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            _ITERATION_TOKEN_BUCKETS,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        phases = {  # vLLM's names for a finished request's intervals
            "prefill": "Histogram of time spent in PREFILL phase for request.",
            "decode": "Histogram of time spent in DECODE phase for request.",
            "inference": "Histogram of time spent in RUNNING phase for request.",
        }
        self.phase_time = {
            phase: histogram(f"vllm:request_{phase}_time_seconds", doc, _REQUEST_LATENCY_BUCKETS)
            for phase, doc in phases.items()
        }
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _ITL_BUCKETS,
        )

    def _request_histograms(self, token_buckets: list[int]) -> None:
        histogram = self._histogram
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20]
        )
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )

    def _vllm_032_counters(self) -> None:
        counter = self._counter
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
        )
        counter(
            "vllm:mm_cache_queries",
            "Multi-modal cache queries, in terms of number of queried items.",
        )
        counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [*_LABELS, "source"],
            registry=self.registry,
        )
        self.prompt_computed = by_source.labels(*self._values, "local_compute")
        self.prompt_cache_hit = by_source.labels(*self._values, "local_cache_hit")
        by_source.labels(*self._values, "external_kv_transfer")
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local "
            "HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM "
            "instance) or external_unspecified.",
            [*_LABELS, "source"],
            registry=self.registry,
        )
        self.prompt_cached_device = cached_by_source.labels(*self._values, "device")
        self._rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=self.registry,
        ).labels(self._values[0], "max_num_queued_reqs")
        self._rejections_seen = 0

    def _vllm_032_histograms(self, max_model_len: int) -> None:
        """The perf estimates, the KV-event drops and the per-request histograms vLLM 0.32
        added."""
        counter = self._counter
        self.perf = [
            counter(
                f"vllm:estimated_{what}_per_gpu",
                f"Estimated number of {doc} per GPU (for Model Flops Utilization calculations).",
            )
            for what, doc in (
                ("flops", "floating point operations"),
                ("read_bytes", "bytes read from memory"),
                ("write_bytes", "bytes written to memory"),
            )
        ]
        self.kv_events_dropped = counter(
            "kvflow:kv_events_dropped",
            "KV-event batches dropped because the publisher's queue was full.",
        )
        self.request_preemptions = self._histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            [0, 1, 2, 3, 4, 5, 10, 20, 50],
        )
        self.prefill_kv_computed = self._histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            build_1_2_5_buckets(max_model_len),
        )

    def _legacy_names(self) -> None:
        """The pre-v1 names the vLLM production-stack router still scrapes."""
        self.legacy_usage = self._gauge(
            "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage."
        )
        self.legacy_queries = self._counter(
            "vllm:gpu_prefix_cache_queries",
            "GPU prefix cache queries, in terms of number of queried tokens.",
        )
        self.legacy_hits = self._counter(
            "vllm:gpu_prefix_cache_hits",
            "GPU prefix cache hits, in terms of number of cached tokens.",
        )

    def sync_front_end(self, admission_rejections: int) -> None:
        """Counters kept by the API process (AsyncEngine), read when /metrics is scraped."""
        if admission_rejections > self._rejections_seen:
            self._rejections.inc(admission_rejections - self._rejections_seen)
            self._rejections_seen = admission_rejections

    def record(self, stats: IterationStats) -> None:
        """Called by the engine loop after every pass (thread-safe: prometheus_client locks)."""
        engine = stats.engine
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.waiting_capacity.set(engine.num_waiting_for_capacity)
        self.waiting_deferred.set(engine.num_waiting - engine.num_waiting_for_capacity)
        self.kv_usage.set(engine.kv_cache_usage)
        self.preemptions.inc(stats.num_preemptions)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.prefix_queries.inc(stats.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits)
        self.legacy_usage.set(engine.kv_cache_usage)
        self.legacy_queries.inc(stats.prefix_cache_queries)
        self.legacy_hits.inc(stats.prefix_cache_hits)
        cached = stats.num_cached_prompt_tokens
        self.prompt_cached.inc(cached)
        self.prompt_cached_device.inc(cached)
        self.prompt_cache_hit.inc(cached)
        self.prompt_computed.inc(stats.num_prompt_tokens - cached)
        for counter, value in zip(
            self.perf,
            (stats.estimated_flops, stats.estimated_read_bytes, stats.estimated_write_bytes),
            strict=True,
        ):
            counter.inc(value)
        self.kv_events_dropped.inc(stats.kv_events_dropped)
        self.info.touch()
        self.stuck_failed.inc(stats.num_stuck_failures)
        self.grammar_failed.inc(stats.num_grammar_failures)
        for seconds in stats.grammar_compile_times:
            self.grammar_compile.observe(seconds)
        if stats.num_iteration_tokens:
            self.iteration_tokens.observe(stats.num_iteration_tokens)
        for ttft in stats.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.itl.observe(itl)
        for done in stats.finished:
            self._success.labels(*self._values, done.finish_reason).inc()
            self.e2e.observe(done.e2e_latency)
            self.queue_time.observe(done.queued_time)
            self.request_prompt_tokens.observe(done.num_prompt_tokens)
            self.request_generation_tokens.observe(done.num_generation_tokens)
            self.phase_time["prefill"].observe(done.prefill_time)
            self.phase_time["decode"].observe(done.decode_time)
            self.phase_time["inference"].observe(done.inference_time)
            self.tpot.observe(done.time_per_output_token)
            self.request_preemptions.observe(done.num_preemptions)
            self.prefill_kv_computed.observe(done.prefill_kv_computed_tokens)
            self.params_n.observe(done.n)
            self.max_generation_tokens.observe(done.max_choice_tokens)
            if done.max_tokens:
                self.params_max_tokens.observe(done.max_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
