"""Least attained service: demotion per threshold passed, bounded aging, the service measure."""

from __future__ import annotations

import pytest

from marsproxy.sched.config import SchedulerConfig, SchedulerTuning
from marsproxy.sched.priority import SessionService, demotion, promotion, service_of

CFG = SchedulerConfig()


@pytest.mark.parametrize(
    ("service", "want"),
    [(0.0, 0), (2048.0, 0), (2049.0, 1), (8192.0, 1), (8193.0, 2), (32768.0, 2),
     (32769.0, 3), (1e9, 3)],
)
def test_demotion_one_level_per_threshold_passed(service: float, want: int) -> None:
    assert demotion(service, CFG) == want


@pytest.mark.parametrize(
    ("waited", "want"), [(-3.0, 0), (0.0, 0), (29.9, 0), (30.0, 1), (65.0, 2), (90.0, 3)],
)
def test_aging_promotes_one_level_per_whole_period(waited: float, want: int) -> None:
    assert promotion(waited, CFG) == want


def test_custom_thresholds_and_period() -> None:
    cfg = SchedulerConfig(
        tuning=SchedulerTuning(service_thresholds=(1.0, 2.0, 3.0), aging_period_s=5.0))
    assert (demotion(1.5, cfg), demotion(3.5, cfg)) == (1, 3)
    assert (promotion(4.9, cfg), promotion(10.0, cfg)) == (0, 2)


def test_service_measure() -> None:
    assert service_of(CFG, 1000, 200, 3.5) == 1200.0
    secs = SchedulerConfig(
        tuning=SchedulerTuning(
            service_measure="engine_seconds", service_thresholds=(1.0, 5.0, 20.0)))
    assert service_of(secs, 1000, 200, 3.5) == 3.5
    assert service_of(secs, 1000, 200, -1.0) == 0.0
    assert demotion(service_of(secs, 1000, 200, 3.5), secs) == 1


def test_session_service_accumulates_and_forgets() -> None:
    s = SessionService()
    assert s.attained("a") == 0.0
    assert s.add("a", 1500.0) == 1500.0
    assert s.add("a", 1000.0) == 2500.0
    s.add("b", 10.0)
    assert (s.attained("a"), s.attained("b"), len(s)) == (2500.0, 10.0, 2)
    assert demotion(s.attained("a"), CFG) == 1
    s.forget("a")
    s.forget("missing")
    assert (s.attained("a"), len(s)) == (0.0, 1)
    with pytest.raises(ValueError):
        s.add("b", -1.0)
