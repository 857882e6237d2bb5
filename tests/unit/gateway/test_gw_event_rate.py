"""The per-session token bucket of tool events (pure, clock injected)."""

from __future__ import annotations

import pytest

from marsproxy.gateway.shells.event_rate import EventRate


def test_burst_then_rate() -> None:
    r = EventRate(rate_per_s=2.0, burst=3)
    assert [r.take("s", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert r.take("s", 0.0) == pytest.approx(0.5)  # one token back after 1/rate
    assert r.take("s", 0.25) == pytest.approx(0.25)
    assert r.take("s", 0.5) == 0.0
    assert r.take("other", 0.5) == 0.0  # per key


def test_refused_takes_do_not_dig_a_hole() -> None:
    r = EventRate(rate_per_s=1.0, burst=1)
    assert r.take("s", 0.0) == 0.0
    for _ in range(100):
        r.take("s", 0.1)  # refused; must not push the next allowed time out
    assert r.take("s", 1.0) == 0.0


def test_full_buckets_are_dropped() -> None:
    r = EventRate(rate_per_s=10.0, burst=2)
    for i in range(50):
        r.take(f"s{i}", 0.0)
    assert len(r) == 50
    r.take("late", 10.0)  # all others refilled long ago
    assert len(r) == 1


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert EventRate.retry_after_s(0.01) == 1
    assert EventRate.retry_after_s(2.2) == 3
    with pytest.raises(ValueError):
        EventRate(0, 1)
