"""vLLM ``/metrics`` pages → typed samples (their rates: ``vllm_rates``). Pure: no I/O.

The page is parsed with ``prometheus_client.parser`` (the project's one metrics parser), and
series are matched by *sample* name (``vllm:num_preemptions_total``, ``..._seconds_sum``), which
does not depend on how the parser names families or whether ``# TYPE`` lines are present.

Data-parallel servers label every series with ``engine`` (one value per rank). Counts and
counters are SUMMED over ranks (the worker's total load and throughput); KV usage is the MAX
over ranks, because the most loaded rank is the one that preempts first and so decides
saturation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from prometheus_client.parser import text_string_to_metric_families

KV_USAGE = "vllm:kv_cache_usage_perc"
# Removed in vLLM 0.32; older servers still emit it only.
KV_USAGE_DEPRECATED = "vllm:gpu_cache_usage_perc"
CACHE_CONFIG_INFO = "vllm:cache_config_info"
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
ADMISSION_REJECTIONS = "vllm:admission_rejections_total"
PROCESS_START = "process_start_time_seconds"

# WorkerMetrics field ← sample name, for every value summed over engines (and other labels).
_SUMMED: Mapping[str, str] = MappingProxyType(
    {
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:num_preemptions_total": "preemptions_total",
        "vllm:prefix_cache_queries_total": "prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total": "prefix_cache_hits_total",
        "vllm:prompt_tokens_total": "prompt_tokens_total",
        "vllm:generation_tokens_total": "generation_tokens_total",
        ADMISSION_REJECTIONS: "admission_rejections_total",
        "vllm:time_to_first_token_seconds_sum": "ttft_sum_s",
        "vllm:time_to_first_token_seconds_count": "ttft_count",
        "vllm:request_prefill_time_seconds_sum": "prefill_time_sum_s",
        "vllm:request_prefill_time_seconds_count": "prefill_time_count",
        "vllm:request_prompt_tokens_sum": "request_prompt_tokens_sum",
        "vllm:request_prompt_tokens_count": "request_prompt_tokens_count",
        "vllm:request_prefill_kv_computed_tokens_sum": "prefill_computed_tokens_sum",
    }
)

# Monotonic values: a decrease of any of them means the server restarted.
COUNTERS = (
    "preemptions_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "admission_rejections_total",
    "ttft_sum_s",
    "ttft_count",
    "prefill_time_sum_s",
    "prefill_time_count",
    "request_prompt_tokens_sum",
    "request_prompt_tokens_count",
    "prefill_computed_tokens_sum",
)


# Only lines starting with one of these reach the Prometheus parser. A real 0.32 page has ~660
# lines, mostly histogram buckets and a 40-label info series we do not read; parsing them all
# cost ~30 ms CPU per page, selecting first cuts that ~10-fold. Prefixes may let a few extra
# lines through; samples are still matched by exact name after parsing.
_SELECTED_PREFIXES = (
    *_SUMMED,
    KV_USAGE,
    KV_USAGE_DEPRECATED,
    WAITING_BY_REASON,
    CACHE_CONFIG_INFO,
    PROCESS_START,
)
# What the scraper asks for (prometheus_client's ``name[]`` filter, which vLLM's mounted
# ``/metrics/`` honours): the server then renders these series only, under half the CPU of the
# whole page.
READ_NAMES = _SELECTED_PREFIXES
# cache_config_info has ~40 labels and costs a third of a parse; it only changes on a restart.
_SELECTED_WITHOUT_CACHE_CONFIG = tuple(p for p in _SELECTED_PREFIXES if p != CACHE_CONFIG_INFO)


class MetricsParseError(ValueError):
    """The page is not a vLLM metrics page: an HTML error page, JSON, text without a single
    ``vllm:`` series, or a malformed line among the series this module reads.

    Raised rather than returning an empty sample, so that a broken endpoint counts as a scrape
    error and the worker turns stale (fail closed) instead of looking idle. A vLLM page that
    lacks some series (older or newer versions) is not an error: those fields are ``None``.
    """


@dataclass(frozen=True, slots=True)
class WorkerMetrics:
    """One scrape of one worker, summed over its engines (data-parallel ranks).

    Every value is ``None`` when the page does not carry it (or carries only NaN). Counters
    are cumulative since the server started; :class:`MetricsTracker` turns them into rates.
    """

    sampled_at: float
    """Clock time of the scrape (the caller's clock, seconds)."""
    engines: tuple[str, ...] = ()
    """Distinct ``engine`` label values seen on vLLM series, sorted."""
    kv_usage: float | None = None
    """KV-cache usage, fraction 0..1, MAX over engines."""
    kv_usage_source: str | None = None
    """Which metric ``kv_usage`` came from: :data:`KV_USAGE` or :data:`KV_USAGE_DEPRECATED`."""
    running: int | None = None
    waiting: int | None = None
    waiting_by_reason: Mapping[str, int] = field(default_factory=dict)
    """``vllm:num_requests_waiting_by_reason`` summed over engines, by ``reason``."""
    preemptions_total: float | None = None
    prefix_cache_queries_total: float | None = None
    """Queried prompt tokens (not requests)."""
    prefix_cache_hits_total: float | None = None
    """Prompt tokens found in the prefix cache."""
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    admission_rejections_total: float | None = None
    """vLLM's own queue-limit rejections (its 503s), summed over ``reason``."""
    block_size: int | None = None
    """Tokens per KV block, from ``vllm:cache_config_info`` (the same on every engine)."""
    num_gpu_blocks: int | None = None
    """KV blocks, from ``vllm:cache_config_info``, summed over engines."""
    ttft_sum_s: float | None = None
    ttft_count: float | None = None
    prefill_time_sum_s: float | None = None
    prefill_time_count: float | None = None
    request_prompt_tokens_sum: float | None = None
    """Sum of the prompt-length histogram (observed when a request finishes)."""
    request_prompt_tokens_count: float | None = None
    prefill_computed_tokens_sum: float | None = None
    """Sum of ``vllm:request_prefill_kv_computed_tokens``: prompt tokens actually computed
    (prefix-cache hits excluded), observed when a request finishes."""
    process_start_time_s: float | None = None
    """``process_start_time_seconds`` of the API server; a change means a restart."""

    @property
    def kv_capacity_tokens(self) -> int | None:
        """KV-cache size in tokens (``block_size × num_gpu_blocks``), if both are known."""
        if self.block_size is None or self.num_gpu_blocks is None:
            return None
        return self.block_size * self.num_gpu_blocks


def _as_int(label: str | None) -> int | None:
    # cache_config_info labels are str(python value): "32", "None", "160".
    if label is None:
        return None
    try:
        n = int(label)
    except ValueError:
        return None
    return n if n > 0 else None


def parse_vllm_metrics(
    text: str, now: float, *, known_cache_config: tuple[int | None, int | None] | None = None
) -> WorkerMetrics:
    """Parse a vLLM ``/metrics`` page taken at clock time ``now``.

    ``known_cache_config`` = (block_size, num_gpu_blocks) from an earlier sample of the same
    server process: the ``vllm:cache_config_info`` line is then skipped, not parsed.

    Sums over engines and other labels; KV usage is the max over engines, read from
    :data:`KV_USAGE` and, only when that is absent, from :data:`KV_USAGE_DEPRECATED`. NaN,
    infinite and negative samples (no vLLM series is negative) are ignored as if missing, as
    are sums that overflow; KV usage above 1 reads as 1 (full). Missing series give ``None``
    fields.

    Only the lines of the series read here are handed to ``prometheus_client``'s parser (see
    ``_SELECTED_PREFIXES``); other lines are neither parsed nor validated.

    Raises :class:`MetricsParseError` when the page has no ``vllm:`` series at all, or when
    the parser rejects one of the selected lines.
    """
    lines = text.splitlines()
    if not any(line.startswith("vllm:") for line in lines):
        raise MetricsParseError(f"no vllm: series on the page (starts {text[:60]!r})")
    prefixes = _SELECTED_PREFIXES if known_cache_config is None else _SELECTED_WITHOUT_CACHE_CONFIG
    selected = "\n".join(line for line in lines if line.startswith(prefixes))
    try:
        families = list(text_string_to_metric_families(selected + "\n"))
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise MetricsParseError(f"malformed metrics line: {exc}") from exc

    sums: dict[str, float] = {}
    kv_max: dict[str, float] = {}
    by_reason: dict[str, float] = {}
    engines: set[str] = set()
    block_size: int | None = None
    blocks_by_engine: dict[str, int] = {}
    start_time: float | None = None

    for family in families:
        for sample in family.samples:
            name = sample.name
            value = float(sample.value)
            if not math.isfinite(value) or value < 0:
                continue
            labels = sample.labels
            if name.startswith("vllm:"):
                engine = labels.get("engine")
                if engine is not None:
                    engines.add(engine)
            target = _SUMMED.get(name)
            if target is not None:
                sums[target] = sums.get(target, 0.0) + value
            elif name in (KV_USAGE, KV_USAGE_DEPRECATED):
                kv_max[name] = max(kv_max.get(name, value), value)
            elif name == WAITING_BY_REASON:
                reason = labels.get("reason", "")
                by_reason[reason] = by_reason.get(reason, 0.0) + value
            elif name == CACHE_CONFIG_INFO:
                size = _as_int(labels.get("block_size"))
                if size is not None:
                    block_size = size if block_size is None else max(block_size, size)
                blocks = _as_int(labels.get("num_gpu_blocks"))
                if blocks is not None:
                    # Keyed by engine: one info series per rank, each with its own cache.
                    blocks_by_engine[labels.get("engine", "")] = blocks
            elif name == PROCESS_START:
                start_time = value

    if known_cache_config is not None:
        block_size, known_blocks = known_cache_config
        if known_blocks is not None:
            blocks_by_engine = {"": known_blocks}

    kv_source = (
        KV_USAGE
        if KV_USAGE in kv_max
        else (KV_USAGE_DEPRECATED if KV_USAGE_DEPRECATED in kv_max else None)
    )

    # Finite samples may still sum to infinity (1e308 on two engines).
    sums = {k: v for k, v in sums.items() if math.isfinite(v)}

    def count(key: str) -> int | None:
        v = sums.get(key)
        return None if v is None else round(v)

    return WorkerMetrics(
        sampled_at=now,
        engines=tuple(sorted(engines)),
        kv_usage=min(1.0, kv_max[kv_source]) if kv_source is not None else None,
        kv_usage_source=kv_source,
        running=count("running"),
        waiting=count("waiting"),
        waiting_by_reason={k: round(v) for k, v in sorted(by_reason.items())
                           if math.isfinite(v)},
        preemptions_total=sums.get("preemptions_total"),
        prefix_cache_queries_total=sums.get("prefix_cache_queries_total"),
        prefix_cache_hits_total=sums.get("prefix_cache_hits_total"),
        prompt_tokens_total=sums.get("prompt_tokens_total"),
        generation_tokens_total=sums.get("generation_tokens_total"),
        admission_rejections_total=sums.get("admission_rejections_total"),
        block_size=block_size,
        num_gpu_blocks=sum(blocks_by_engine.values()) if blocks_by_engine else None,
        ttft_sum_s=sums.get("ttft_sum_s"),
        ttft_count=sums.get("ttft_count"),
        prefill_time_sum_s=sums.get("prefill_time_sum_s"),
        prefill_time_count=sums.get("prefill_time_count"),
        request_prompt_tokens_sum=sums.get("request_prompt_tokens_sum"),
        request_prompt_tokens_count=sums.get("request_prompt_tokens_count"),
        prefill_computed_tokens_sum=sums.get("prefill_computed_tokens_sum"),
        process_start_time_s=start_time,
    )


