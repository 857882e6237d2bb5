"""The tool-CPU signal: inferred tool phases count only where tools run and the CPUs show it."""

from __future__ import annotations

import pytest

from marsproxy.probes.cpu import CpuPressure
from marsproxy.probes.tool_phases import ToolPhaseTracker, ToolTrackerSettings
from marsproxy.probes.tool_signal import ToolCpuSignal, ToolLocation


def tracker() -> ToolPhaseTracker:
    """Two CPUs; four plain sessions between calls (inferred) and one harness-reported tool."""
    t = ToolPhaseTracker(ToolTrackerSettings(tool_cpus=2.0, inferred_min_s=0.5))
    for i in range(4):
        t.response_ended(f"plain{i}", 0.0)
    t.explicit_event("agent", "tool_start", "pytest", 0.0, 1.5)
    return t


def reading(at: float, *, psi: float | None = None, throttled: int | None = None,
            busy: float | None = None) -> CpuPressure:
    return CpuPressure(sampled_at=at, source="test", psi_some_avg10=psi,
                       nr_throttled=throttled, cpu_percent=busy, tool_cpus=2.0)


def signal(location: str) -> ToolCpuSignal:
    return ToolCpuSignal(location, confirm_psi=50.0, confirm_cpu_percent=80.0)


def test_host_counts_inferred_phases_only_when_psi_confirms() -> None:
    t, sig = tracker(), signal("host")
    sig.observe(reading(0.0, psi=3.0))  # an idle host: the gaps are no tools of this host
    quiet = sig.signals(t, 1.0)
    assert (quiet.tools_in_flight, quiet.backlog_ratio) == (1, 0.5)
    assert not quiet.inferred_counted and quiet.psi_some_avg10 == 3.0
    sig.observe(reading(1.0, psi=85.0))
    busy = sig.signals(t, 1.0)
    assert (busy.tools_in_flight, busy.backlog_ratio) == (5, 2.5) and busy.inferred_counted


def test_host_throttling_confirms_and_the_same_reading_counts_once() -> None:
    t, sig = tracker(), signal("host")
    first = reading(0.0, psi=1.0, throttled=10)
    sig.observe(first)
    sig.observe(reading(1.0, psi=1.0, throttled=14))  # throttled since the last reading
    assert sig.signals(t, 1.0).inferred_counted
    again = reading(2.0, psi=1.0, throttled=14)
    sig.observe(again)
    assert not sig.signals(t, 2.0).inferred_counted
    sig.observe(again)  # polled twice between probe readings: no change
    assert not sig.confirmed


@pytest.mark.parametrize(("busy", "counted"), [(None, False), (40.0, False), (95.0, True)])
def test_host_without_psi_falls_back_to_cpu_busy(busy: float | None, counted: bool) -> None:
    t, sig = tracker(), signal("host")
    sig.observe(reading(0.0, busy=busy))
    assert sig.signals(t, 1.0).inferred_counted is counted


def test_reported_counts_only_what_harnesses_report() -> None:
    t, sig = tracker(), signal("reported")
    sig.observe(reading(0.0, psi=99.0))
    s = sig.signals(t, 1.0)
    assert (s.tools_in_flight, s.backlog_ratio, s.tool_wait_ema_s) == (1, 0.5, pytest.approx(0.3))
    assert s.psi_some_avg10 is None  # the host's pressure is not the tools'


def test_elsewhere_counts_nothing() -> None:
    t, sig = tracker(), signal(ToolLocation.ELSEWHERE)
    sig.observe(reading(0.0, psi=99.0, throttled=5))
    s = sig.signals(t, 1.0)
    assert (s.tools_in_flight, s.backlog_ratio, s.tool_wait_ema_s, s.psi_some_avg10) == (
        0, 0.0, 0.0, None)


def test_explicit_counts_follow_phases_that_end() -> None:
    t = tracker()
    assert (t.explicit_in_flight, t.pressing(1.0, inferred=False)) == (1, 1)
    t.explicit_event("agent", "tool_end", "pytest", 2.0, None)
    t.request_started("plain0", 2.0)
    assert (t.explicit_in_flight, t.pressing(2.0, inferred=False), t.in_flight) == (0, 0, 3)
    t.session_ended("plain1")
    assert t.in_flight == 2 and t.pressing(3.0) == 2
