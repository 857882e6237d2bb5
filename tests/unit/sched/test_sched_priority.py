"""MLFQ level: buckets at the boundaries, warm vs cold, demotion, bounded aging."""

from __future__ import annotations

import pytest

from marsproxy.sched.config import SchedulerConfig, SchedulerTuning
from marsproxy.sched.priority import (
    SessionService,
    level,
    prefill_bucket,
    service_of,
    uncached_tokens,
)

CFG = SchedulerConfig()


@pytest.mark.parametrize(
    ("tokens", "want"),
    [
        (0, 0), (1, 0), (2048, 0), (2049, 1), (8192, 1), (8193, 2),
        (32768, 2), (32769, 3), (1_000_000, 3), (-5, 0),
    ],
)
def test_buckets_at_boundaries(tokens: int, want: int) -> None:
    assert prefill_bucket(tokens, CFG) == want
    assert level(tokens, 0.0, 0.0, CFG) == want


def test_warm_continuation_counts_only_new_tokens() -> None:
    # 40k-token context, 500 new tokens: cold it is level 3, warm (prefix retained) level 0.
    prompt = 40_500
    assert level(uncached_tokens(prompt, 0), 0.0, 0.0, CFG) == 3
    assert level(uncached_tokens(prompt, 40_000), 0.0, 0.0, CFG) == 0
    assert uncached_tokens(100, 500) == 0


@pytest.mark.parametrize(
    ("service", "want"),
    [(0.0, 0), (2048.0, 0), (2049.0, 1), (8192.0, 1), (8193.0, 2), (32769.0, 3), (1e9, 3)],
)
def test_demotion_one_level_per_threshold_passed(service: float, want: int) -> None:
    assert level(100, service, 0.0, CFG) == want


def test_demotion_capped_at_lowest_level() -> None:
    # bucket 2 + demotion 2 would be 4; capped at 3.
    assert level(10_000, 10_000.0, 0.0, CFG) == 3


def test_aging_promotes_one_level_per_period_bounded_at_zero() -> None:
    assert level(40_000, 0.0, 29.9, CFG) == 3
    assert level(40_000, 0.0, 30.0, CFG) == 2
    assert level(40_000, 0.0, 65.0, CFG) == 1
    assert level(40_000, 0.0, 90.0, CFG) == 0
    assert level(40_000, 0.0, 10_000.0, CFG) == 0
    assert level(100, 0.0, 120.0, CFG) == 0
    assert level(100, 0.0, -3.0, CFG) == 0


def test_aging_applies_after_the_cap() -> None:
    # bucket 3 + demotion 3 = 6 → capped 3; one period of waiting gives 2, not 5.
    assert level(40_000, 1e9, 30.0, CFG) == 2


def test_custom_thresholds_and_period() -> None:
    cfg = SchedulerConfig(
        tuning=SchedulerTuning(
            level_thresholds=(10, 20, 30), service_thresholds=(1.0, 2.0, 3.0), aging_period_s=5.0))
    assert level(15, 0.0, 0.0, cfg) == 1
    assert level(15, 1.5, 0.0, cfg) == 2
    assert level(15, 1.5, 5.0, cfg) == 1


def test_service_measure() -> None:
    assert service_of(CFG, 1000, 200, 3.5) == 1200.0
    secs = SchedulerConfig(
        tuning=SchedulerTuning(
            service_measure="engine_seconds", service_thresholds=(1.0, 5.0, 20.0)))
    assert service_of(secs, 1000, 200, 3.5) == 3.5
    assert level(100, service_of(secs, 1000, 200, 3.5), 0.0, secs) == 1


def test_session_service_accumulates_and_forgets() -> None:
    s = SessionService()
    assert s.attained("a") == 0.0
    assert s.add("a", 1500.0) == 1500.0
    assert s.add("a", 1000.0) == 2500.0
    s.add("b", 10.0)
    assert (s.attained("a"), s.attained("b"), len(s)) == (2500.0, 10.0, 2)
    assert level(100, s.attained("a"), 0.0, CFG) == 1
    s.forget("a")
    s.forget("missing")
    assert (s.attained("a"), len(s)) == (0.0, 1)
    with pytest.raises(ValueError):
        s.add("b", -1.0)
