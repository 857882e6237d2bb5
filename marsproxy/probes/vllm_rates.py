"""Successive samples of one vLLM worker's ``/metrics`` → rates: preemptions, prefix-cache hits,
tokens in and out, admission rejections, the prefill speed (from the best source the page has),
and restarts. Pure: no I/O, ``now`` is a parameter."""

from __future__ import annotations

from dataclasses import dataclass

from marsproxy.probes.vllm_metrics import COUNTERS, WorkerMetrics

PREFILL_FROM_COMPUTED = "request_prefill_kv_computed_tokens_sum/request_prefill_time_seconds_sum"


PREFILL_FROM_PREFILL_TIME = "request_prompt_tokens_sum/request_prefill_time_seconds_sum"


PREFILL_FROM_TTFT = "prompt_tokens_total/time_to_first_token_seconds_sum"


@dataclass(frozen=True, slots=True)
class WorkerRates:
    """What changed between the last two samples of a worker. ``None``: not computable yet."""

    interval_s: float | None = None
    preemptions_per_s: float | None = None
    prefix_cache_hit_rate: float | None = None
    """Δhits / Δqueries over the last interval (tokens), 0..1; ``None`` without queries."""
    prompt_tokens_per_s: float | None = None
    """Prompt tokens the worker took in per wall second (achieved, not capacity)."""
    generation_tokens_per_s: float | None = None
    admission_rejections_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    """Estimated prefill speed; see :meth:`MetricsTracker.update`. Kept from the last interval
    in which a request finished, since most 200 ms intervals see none."""
    prefill_source: str | None = None
    restarted: bool = False
    """Counters went back (or the process start time changed) in this interval."""


class MetricsTracker:
    """Turns successive :class:`WorkerMetrics` of ONE worker into :class:`WorkerRates`."""

    def __init__(self) -> None:
        self._latest: WorkerMetrics | None = None
        self._rates = WorkerRates()
        self.resets = 0
        """Server restarts detected so far."""

    @property
    def latest(self) -> WorkerMetrics | None:
        return self._latest

    @property
    def rates(self) -> WorkerRates:
        return self._rates

    def is_stale(self, now: float, stale_after: float) -> bool:
        """True when there is no sample, or the last one is older than ``stale_after`` s."""
        return self._latest is None or now - self._latest.sampled_at > stale_after

    def update(self, sample: WorkerMetrics) -> WorkerRates:
        """Take a new sample and return the rates over the interval since the previous one.

        Counter resets follow Prometheus' ``rate()``: a counter that went down restarted from
        zero, so its delta is its new value; a changed ``process_start_time_seconds`` means
        the same for every counter. A sample older than the latest is ignored.

        Prefill speed (computed tokens per second of prefill) is estimated, best source first:

        1. Δ``vllm:request_prefill_kv_computed_tokens_sum`` /
           Δ``vllm:request_prefill_time_seconds_sum`` (vLLM 0.32): both histograms are
           observed together when a request finishes, and cache hits are excluded;
        2. Δ``vllm:request_prompt_tokens_sum`` / the same time: counts prefix-cache hits as
           prefilled, so it overstates compute speed when the hit rate is high;
        3. Δ``vllm:prompt_tokens_total`` / Δ``vllm:time_to_first_token_seconds_sum``: TTFT
           includes queueing, so this understates speed under load.

        Prefill times of concurrent requests overlap (chunked prefill batches them), so this is
        the per-request prefill speed, not the engine's aggregate capacity.
        """
        prev = self._latest
        if prev is not None and sample.sampled_at < prev.sampled_at:
            return self._rates
        self._latest = sample
        if prev is None:
            return self._rates
        dt = sample.sampled_at - prev.sampled_at
        if dt <= 0:
            return self._rates

        restarted = _restarted(prev, sample)
        if restarted:
            self.resets += 1

        def delta(key: str) -> float | None:
            cur: float | None = getattr(sample, key)
            old: float | None = getattr(prev, key)
            if cur is None or old is None:
                return None
            if restarted or cur < old:
                return cur
            return cur - old

        def per_s(key: str) -> float | None:
            d = delta(key)
            return None if d is None else d / dt

        d_queries = delta("prefix_cache_queries_total")
        d_hits = delta("prefix_cache_hits_total")
        hit_rate = None
        if d_queries is not None and d_hits is not None and d_queries > 0:
            hit_rate = min(1.0, d_hits / d_queries)

        prefill, source = self._rates.prefill_tokens_per_s, self._rates.prefill_source
        for tokens_key, time_key, label in (
            ("prefill_computed_tokens_sum", "prefill_time_sum_s", PREFILL_FROM_COMPUTED),
            ("request_prompt_tokens_sum", "prefill_time_sum_s", PREFILL_FROM_PREFILL_TIME),
            ("prompt_tokens_total", "ttft_sum_s", PREFILL_FROM_TTFT),
        ):
            d_tokens, d_time = delta(tokens_key), delta(time_key)
            if d_tokens is not None and d_time is not None:
                if d_time > 0:
                    prefill, source = d_tokens / d_time, label
                # The better source exists: use only it, even when this interval had nothing.
                break

        self._rates = WorkerRates(
            interval_s=dt,
            preemptions_per_s=per_s("preemptions_total"),
            prefix_cache_hit_rate=hit_rate,
            prompt_tokens_per_s=per_s("prompt_tokens_total"),
            generation_tokens_per_s=per_s("generation_tokens_total"),
            admission_rejections_per_s=per_s("admission_rejections_total"),
            prefill_tokens_per_s=prefill,
            prefill_source=source,
            restarted=restarted,
        )
        return self._rates


def _restarted(prev: WorkerMetrics, cur: WorkerMetrics) -> bool:
    if (
        prev.process_start_time_s is not None
        and cur.process_start_time_s is not None
        and cur.process_start_time_s != prev.process_start_time_s
    ):
        return True
    for key in COUNTERS:
        old: float | None = getattr(prev, key)
        new: float | None = getattr(cur, key)
        if old is not None and new is not None and new < old:
            return True
    return False
