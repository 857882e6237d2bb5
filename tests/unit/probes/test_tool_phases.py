"""Tool-phase tracker: inferred phases, explicit events override, estimates."""

from __future__ import annotations

from marsproxy.core.events import ToolEnd, ToolStart
from marsproxy.probes.tool_phases import ToolPhaseTracker, ToolTrackerSettings, quantile


def _tracker(cpus: float = 2.0) -> ToolPhaseTracker:
    return ToolPhaseTracker(ToolTrackerSettings(tool_cpus=cpus, history=8))


def test_inferred_phase_from_response_end_to_next_request() -> None:
    t = _tracker()
    assert t.request_started("a", 0.0) == []  # first request: no phase was open
    [start] = t.response_ended("a", 1.0)
    assert isinstance(start, ToolStart) and start.inferred and start.session == "a"
    assert t.in_flight == 1 and t.backlog_ratio(1.0) == 0.0  # too young to press
    assert t.backlog_ratio(1.5) == 0.5
    [end] = t.request_started("a", 4.5)
    assert isinstance(end, ToolEnd) and end.duration_s == 3.5 and end.inferred
    assert t.in_flight == 0
    assert t.predicted_duration("a") == 3.5


def test_explicit_events_override_inference_without_double_counting() -> None:
    t = _tracker()
    t.response_ended("a", 1.0)  # inferred phase opens
    assert t.in_flight == 1
    [start] = t.explicit_event("a", "tool_start", "pytest", 1.2, queue_wait_s=0.5)
    assert isinstance(start, ToolStart) and not start.inferred and start.tool == "pytest"
    assert t.in_flight == 1  # the inferred phase was replaced, not added to
    [end] = t.explicit_event("a", "tool_end", "pytest", 11.2, queue_wait_s=None)
    assert isinstance(end, ToolEnd) and end.duration_s == 10.0 and end.tool == "pytest"
    assert t.in_flight == 0
    # Once explicit, gaps between requests are no longer inferred as tools.
    assert t.response_ended("a", 12.0) == []
    assert t.request_started("a", 20.0) == []
    assert t.usual_duration("pytest") == 10.0


def test_queue_wait_ema_uses_alpha() -> None:
    t = _tracker()
    t.explicit_event("a", "tool_start", "build", 0.0, queue_wait_s=10.0)
    assert t.queue_wait_ema == 2.0  # 0.2 * 10 + 0.8 * 0
    t.explicit_event("b", "tool_start", "build", 0.0, queue_wait_s=0.0)
    assert abs(t.queue_wait_ema - 1.6) < 1e-9
    assert t.in_flight == 2


def test_high_quantile_not_mean_and_per_kind() -> None:
    t = _tracker()
    clock = 0.0
    for d in (1, 1, 1, 1, 1, 1, 1, 1, 1, 20):
        t.explicit_event("a", "tool_start", "test", clock, None)
        clock += d
        t.explicit_event("a", "tool_end", "test", clock, None)
    # history 8 keeps the last 8 durations: seven 1 s and one 20 s; p90 is the 20 s one
    assert t.predicted_duration("a", "test") == 20.0
    assert t.usual_duration("test") == 1.0
    assert t.predicted_duration("b", "read") is None


def test_slowdown_rises_when_tools_take_longer_than_usual() -> None:
    t = _tracker()
    for i in range(5):
        t.explicit_event("a", "tool_start", "test", 10.0 * i, None)
        t.explicit_event("a", "tool_end", "test", 10.0 * i + 2.0, None)
    assert abs(t.slowdown_ema - 1.0) < 1e-9
    t.explicit_event("b", "tool_start", "test", 100.0, None)
    t.explicit_event("b", "tool_end", "test", 108.0, None)  # 4x the usual 2 s
    assert t.slowdown_ema > 1.5


def test_session_end_closes_open_phase() -> None:
    t = _tracker()
    t.response_ended("a", 1.0)
    assert [s for s, _, _ in t.sessions_in_tool_phase()] == ["a"]
    t.session_ended("a")
    assert t.in_flight == 0 and t.sessions_in_tool_phase() == []


def test_quantile_nearest_rank() -> None:
    assert quantile([], 0.9) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([float(i) for i in range(1, 11)], 0.9) == 9.0


def test_short_gaps_between_calls_never_press_on_the_cpus() -> None:
    # A client that runs no tools (or answers at once) leaves millisecond gaps: these are
    # open phases, but they must not read as a CPU backlog.
    t = _tracker(cpus=1.0)
    for i in range(8):
        t.response_ended(f"s{i}", 10.0)
    assert t.in_flight == 8 and t.pressing(10.3) == 0
    for i in range(8):
        t.request_started(f"s{i}", 10.31)
    assert t.in_flight == 0 and t.pressing(20.0) == 0  # closed young: never counted


def test_long_inferred_phases_press_once_old_and_stop_when_closed() -> None:
    t = _tracker(cpus=2.0)
    t.response_ended("a", 0.0)
    t.response_ended("b", 0.3)
    assert t.pressing(0.6) == 1 and t.backlog_ratio(0.6) == 0.5
    assert t.pressing(0.8) == 2
    t.request_started("a", 1.0)
    assert t.pressing(1.0) == 1
    # "a" opens a new phase: the old young entry of "a" must not count it early.
    t.response_ended("a", 1.1)
    assert t.pressing(1.2) == 1 and t.pressing(1.6) == 2
    t.session_ended("b")
    assert t.pressing(2.0) == 1


def test_explicit_phases_press_at_once_and_replace_a_young_inferred_one() -> None:
    t = _tracker(cpus=1.0)
    t.response_ended("a", 0.0)
    t.explicit_event("a", "tool_start", "pytest", 0.1, queue_wait_s=None)
    assert t.pressing(0.1) == 1
    assert t.pressing(5.0) == 1  # the replaced inferred entry never adds to it
    t.explicit_event("a", "tool_end", "pytest", 6.0, queue_wait_s=None)
    assert t.pressing(6.0) == 0


def test_zero_threshold_counts_every_inferred_phase_at_once() -> None:
    t = ToolPhaseTracker(ToolTrackerSettings(tool_cpus=1.0, inferred_min_s=0.0))
    t.response_ended("a", 0.0)
    assert t.pressing(0.0) == 1


def test_window_quantiles_match_sorting_the_last_durations() -> None:
    import random

    from marsproxy.probes.tool_phases import _Window

    rng = random.Random(7)
    for size in (1, 3, 64):
        window, seen = _Window(size), []
        assert window.quantile(0.5) is None
        for _ in range(300):
            v = rng.choice([rng.random() * 10, 1.0, 2.0])  # repeats, as real durations have
            window.add(v)
            seen.append(v)
            for q in (0.0, 0.5, 0.9, 1.0):
                assert window.quantile(q) == quantile(seen[-size:], q)
