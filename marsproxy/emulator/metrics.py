"""Prometheus metrics of the emulated worker, named and labelled as vLLM 0.32 names them.

One :class:`EmulatorMetrics` per app, each with its own ``CollectorRegistry`` (no globals).
Times are MODELLED seconds (what the engine's step-time model says), not wall seconds, so a run
with ``time_scale`` 0.1 reports the latencies a real GPU would have.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from marsproxy.emulator.engine import EngineStats, StepResult
from marsproxy.emulator.profiles import EngineProfile
from marsproxy.emulator.request import FinishedEvent

# Bucket boundaries of vLLM's PrometheusStatLogger.
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
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_PREEMPTION_BUCKETS = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
FINISH_REASONS = ("stop", "length", "abort")
ENGINE = "0"


class EmulatorMetrics:
    def __init__(self, profile: EngineProfile) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        base = {"model_name": profile.model_name, "engine": ENGINE}
        names = list(base)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg).labels(**base)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=reg).labels(**base)

        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        ).labels(**base)
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        ).labels(**base)
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting, by reason.",
            [*names, "reason"],
            registry=reg,
        )
        self.waiting_capacity = by_reason.labels(**base, reason="capacity")
        # "deferred" (waiting on remote KV, grammar compilation...) never happens here.
        by_reason.labels(**base, reason="deferred").set(0)
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        ).labels(**base)
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.pc_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.pc_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=reg,
        )
        self.success = {r: success.labels(**base, finished_reason=r) for r in FINISH_REASONS}
        info_labels = cache_config_labels(profile)
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info_labels),
            registry=reg,
        )
        info.labels(**info_labels).set(1)
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
            _LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _LATENCY_BUCKETS,
        )
        self.req_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Number of preemptions per request.",
            _PREEMPTION_BUCKETS,
        )

    def record_step(
        self, result: StepResult, stats: EngineStats, prefix_delta: tuple[int, int]
    ) -> None:
        if result.preemptions_reported:
            self.preemptions.inc(result.preemptions_reported)
        if result.prompt_tokens:
            self.prompt_tokens.inc(result.prompt_tokens)
        if result.generation_tokens:
            self.generation_tokens.inc(result.generation_tokens)
        queries, hits = prefix_delta
        if queries:
            self.pc_queries.inc(queries)
        if hits:
            self.pc_hits.inc(hits)
        for fin in result.finished:
            self.record_finished(fin)
        self.record_state(stats)

    def record_state(self, stats: EngineStats) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.waiting_capacity.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)

    def record_finished(self, fin: FinishedEvent) -> None:
        self.success[fin.finish_reason].inc()
        self.ttft.observe(fin.ttft)
        self.e2e.observe(fin.e2e_latency)
        self.queue.observe(fin.queue_time)
        self.prefill.observe(fin.prefill_time)
        self.decode.observe(fin.decode_time)
        self.req_preemptions.observe(fin.num_preemptions)
        for gap in fin.token_gaps:
            self.itl.observe(gap)

    def render(self, names: list[str] | None = None) -> bytes:
        """The page; ``names``: only those series (prometheus_client's ``name[]`` filter)."""
        if names:
            return generate_latest(self.registry.restricted_registry(names))
        return generate_latest(self.registry)


def cache_config_labels(profile: EngineProfile) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info``: every CacheConfig field vLLM 0.32 exports (label set
    taken from tests/fixtures/vllm-0.32-metrics.txt), with this profile's values."""
    bs = str(profile.block_size)
    tokens = profile.kv_capacity_tokens
    return {
        "_block_size_resolved": "True",
        "block_size": bs,
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": bs,
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": "True",
        "engine": ENGINE,
        "gpu_memory_utilization": "0.9",
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(round(tokens / profile.effective_max_model_len, 2)),
        "kv_cache_memory_bytes": str(tokens * profile.kv_bytes_per_token or "None"),
        "kv_cache_size_tokens": str(tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "auto",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(profile.num_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "True",
    }
