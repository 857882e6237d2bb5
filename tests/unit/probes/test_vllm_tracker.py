"""MetricsTracker: rates from hand-made sample sequences."""

from __future__ import annotations

import pytest

from marsproxy.probes.vllm_metrics import WorkerMetrics
from marsproxy.probes.vllm_rates import (
    PREFILL_FROM_COMPUTED,
    PREFILL_FROM_PREFILL_TIME,
    PREFILL_FROM_TTFT,
    MetricsTracker,
    WorkerRates,
)


def sample(t: float, **kw: float) -> WorkerMetrics:
    return WorkerMetrics(sampled_at=t, **kw)  # type: ignore[arg-type]


def test_first_sample_gives_no_rates() -> None:
    tr = MetricsTracker()
    assert tr.update(sample(0.0, preemptions_total=5)) == WorkerRates()
    assert tr.latest is not None and tr.latest.preemptions_total == 5


def test_rates_over_interval() -> None:
    tr = MetricsTracker()
    tr.update(
        sample(
            10.0,
            preemptions_total=5,
            prefix_cache_queries_total=1000,
            prefix_cache_hits_total=200,
            prompt_tokens_total=1000,
            generation_tokens_total=50,
            admission_rejections_total=0,
        )
    )
    r = tr.update(
        sample(
            10.5,
            preemptions_total=8,
            prefix_cache_queries_total=1400,
            prefix_cache_hits_total=500,
            prompt_tokens_total=1400,
            generation_tokens_total=100,
            admission_rejections_total=2,
        )
    )
    assert r.interval_s == pytest.approx(0.5)
    assert r.preemptions_per_s == pytest.approx(6.0)
    assert r.prefix_cache_hit_rate == pytest.approx(300 / 400)  # this interval, not cumulative
    assert r.prompt_tokens_per_s == pytest.approx(800.0)
    assert r.generation_tokens_per_s == pytest.approx(100.0)
    assert r.admission_rejections_per_s == pytest.approx(4.0)
    assert not r.restarted
    assert tr.rates is r


def test_hit_rate_none_without_queries() -> None:
    tr = MetricsTracker()
    tr.update(sample(0.0, prefix_cache_queries_total=100, prefix_cache_hits_total=50))
    r = tr.update(sample(1.0, prefix_cache_queries_total=100, prefix_cache_hits_total=50))
    assert r.prefix_cache_hit_rate is None


def test_counter_reset_counts_new_value_from_zero() -> None:
    tr = MetricsTracker()
    tr.update(
        sample(
            0.0,
            preemptions_total=100,
            prefix_cache_queries_total=5000,
            prefix_cache_hits_total=4000,
        )
    )
    r = tr.update(
        sample(1.0, preemptions_total=3, prefix_cache_queries_total=100, prefix_cache_hits_total=25)
    )
    assert r.restarted and tr.resets == 1
    assert r.preemptions_per_s == pytest.approx(3.0)  # not -97
    assert r.prefix_cache_hit_rate == pytest.approx(0.25)
    r = tr.update(
        sample(2.0, preemptions_total=5, prefix_cache_queries_total=200, prefix_cache_hits_total=25)
    )
    assert not r.restarted and tr.resets == 1
    assert r.preemptions_per_s == pytest.approx(2.0)


def test_restart_detected_by_process_start_time_even_if_counters_grew() -> None:
    tr = MetricsTracker()
    tr.update(sample(0.0, preemptions_total=2, process_start_time_s=1000.0))
    r = tr.update(sample(1.0, preemptions_total=7, process_start_time_s=2000.0))
    assert r.restarted
    assert r.preemptions_per_s == pytest.approx(7.0)  # 7 since restart, not 5


def test_missing_counter_gives_none_rate() -> None:
    tr = MetricsTracker()
    tr.update(sample(0.0))
    r = tr.update(sample(1.0, preemptions_total=4))
    assert r.preemptions_per_s is None


def test_out_of_order_and_duplicate_samples_are_ignored() -> None:
    tr = MetricsTracker()
    tr.update(sample(5.0, preemptions_total=0))
    r1 = tr.update(sample(6.0, preemptions_total=2))
    assert tr.update(sample(4.0, preemptions_total=0)) is r1
    assert tr.latest is not None and tr.latest.sampled_at == 6.0
    assert tr.update(sample(6.0, preemptions_total=2)) is r1


def test_prefill_estimate_prefers_computed_tokens() -> None:
    tr = MetricsTracker()
    base = dict(
        prefill_computed_tokens_sum=0,
        request_prompt_tokens_sum=0,
        prefill_time_sum_s=0.0,
        prompt_tokens_total=0,
        ttft_sum_s=0.0,
    )
    tr.update(sample(0.0, **base))
    r = tr.update(
        sample(
            0.2,
            prefill_computed_tokens_sum=1000,
            request_prompt_tokens_sum=3000,
            prefill_time_sum_s=0.5,
            prompt_tokens_total=3000,
            ttft_sum_s=2.0,
        )
    )
    assert r.prefill_tokens_per_s == pytest.approx(2000.0)
    assert r.prefill_source == PREFILL_FROM_COMPUTED


def test_prefill_estimate_falls_back_to_prompt_histogram_then_ttft() -> None:
    tr = MetricsTracker()
    tr.update(sample(0.0, request_prompt_tokens_sum=0, prefill_time_sum_s=0.0))
    r = tr.update(sample(1.0, request_prompt_tokens_sum=600, prefill_time_sum_s=0.2))
    assert r.prefill_tokens_per_s == pytest.approx(3000.0)
    assert r.prefill_source == PREFILL_FROM_PREFILL_TIME
    tr = MetricsTracker()
    tr.update(sample(0.0, prompt_tokens_total=0, ttft_sum_s=0.0))
    r = tr.update(sample(1.0, prompt_tokens_total=500, ttft_sum_s=0.5))
    assert r.prefill_tokens_per_s == pytest.approx(1000.0)
    assert r.prefill_source == PREFILL_FROM_TTFT


def test_prefill_estimate_is_kept_through_quiet_intervals() -> None:
    tr = MetricsTracker()
    ttft = dict(prompt_tokens_total=0, ttft_sum_s=0.0)
    tr.update(sample(0.0, prefill_computed_tokens_sum=0, prefill_time_sum_s=0.0, **ttft))
    tr.update(sample(0.2, prefill_computed_tokens_sum=400, prefill_time_sum_s=0.1, **ttft))
    # No request finished: the histograms did not move.
    r = tr.update(sample(0.4, prefill_computed_tokens_sum=400, prefill_time_sum_s=0.1, **ttft))
    assert r.prefill_tokens_per_s == pytest.approx(4000.0)
    # The better source did not move but the TTFT fallback did: it must not replace it.
    r = tr.update(
        sample(
            0.6,
            prefill_computed_tokens_sum=400,
            prefill_time_sum_s=0.1,
            prompt_tokens_total=10,
            ttft_sum_s=1.0,
        )
    )
    assert r.prefill_source == PREFILL_FROM_COMPUTED
    assert r.prefill_tokens_per_s == pytest.approx(4000.0)


@pytest.mark.parametrize(
    ("age", "stale"), [(0.5, False), (1.0, False), (1.0001, True), (30.0, True)]
)
def test_staleness(age: float, stale: bool) -> None:
    tr = MetricsTracker()
    assert tr.is_stale(0.0, 1.0)  # no sample yet: fail closed
    tr.update(sample(100.0))
    assert tr.is_stale(100.0 + age, 1.0) is stale
