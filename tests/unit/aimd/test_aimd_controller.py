"""AimdController driven by scripted pressure traces."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from marsproxy.aimd.config import AdmissionConfig, AdmissionTuning
from marsproxy.aimd.controller import NO_CEILING, AimdController, ControlSignals


def tuned(**kw: Any) -> AdmissionTuning:
    # The window arithmetic below is worked out for a cut to 0.7 per tick (the default is 0.85).
    return AdmissionTuning(decrease=0.7, **kw)


TUNING = tuned()
CFG = AdmissionConfig(tuning=TUNING)
DT = CFG.tuning.control_interval_s


def healthy(admitted: int = 30, **kw: object) -> ControlSignals:
    base: dict[str, object] = dict(kv_usage=0.5, budget_blocks=1000, admitted=admitted)
    base.update(kw)
    return ControlSignals(**base)  # type: ignore[arg-type]


def run(c: AimdController, trace: Iterable[ControlSignals], t0: float = 0.0) -> list[int]:
    """Tick once per control interval; the window after each tick."""
    out = []
    t = t0
    for s in trace:
        c.tick(t, s)
        out.append(c.window)
        t += DT
    return out


def test_collapse_under_sustained_kv_overload() -> None:
    c = AimdController(CFG, "w0")
    # 30 → ⌊21.0⌋ → ⌊14.7⌋ → ⌊9.8⌋ → ⌊6.3⌋ → max(4, ⌊4.2⌋) → max(4, ⌊2.8⌋)
    assert run(c, [healthy(kv_usage=0.95)] * 7) == [21, 14, 9, 6, 4, 4, 4]
    assert c.kv_overloaded and not c.cpu_overloaded
    assert c.kv_cap == 4 and c.effective_limit == 4


def test_window_change_events_carry_reason_and_values() -> None:
    c = AimdController(CFG, "w0")
    evs = c.tick(10.0, healthy(kv_usage=0.95))
    assert len(evs) == 1
    ev = evs[0]
    assert (ev.ts, ev.worker, ev.old, ev.new, ev.reason) == (10.0, "w0", 30, 21, "kv_overload")
    # At the floor nothing changes, so nothing is published.
    run(c, [healthy(kv_usage=0.95)] * 5, t0=10.2)
    assert c.window == 4
    assert c.tick(20.0, healthy(kv_usage=0.95)) == []


@pytest.mark.parametrize(
    "signals",
    [healthy(backlog_ratio=2.0, tool_cpus=2.0), healthy(tool_wait_ema_s=5.0, tool_cpus=2.0)],
)
def test_cpu_overload_holds_the_window_and_the_cap_binds(signals: ControlSignals) -> None:
    # By default CPU overload neither shrinks nor grows the window; the cap, ceil(2 · 4) = 8,
    # bounds the limit at once and for as long as the overload lasts.
    c = AimdController(AdmissionConfig(window_init=20, tuning=TUNING))
    assert run(c, [signals] * 6) == [20] * 6
    assert c.cpu_overloaded and (c.cpu_cap, c.effective_limit) == (8, 8)
    assert c.tick(99.0, signals) == []  # no window change to publish
    # Left (ratio ≤ 1, wait ≤ 2 s): the cap lifts and the window grows from where it was, but
    # without overload it binds nothing: no count ceiling (window_max null).
    assert run(c, [healthy(tool_cpus=2.0)] * 2, t0=100.0) == [21, 22]
    assert not c.cpu_overloaded and c.effective_limit == NO_CEILING


def test_kv_overload_still_shrinks_while_cpu_is_overloaded() -> None:
    c = AimdController(CFG)
    assert run(c, [healthy(kv_usage=0.95, backlog_ratio=3.0)] * 3) == [21, 14, 9]
    # KV back to healthy, CPU still overloaded: held, not cut further and not grown.
    assert run(c, [healthy(kv_usage=0.5, backlog_ratio=3.0)] * 3, t0=5.0) == [9, 9, 9]


def test_both_overloaded_reason() -> None:
    c = AimdController(CFG)
    (ev,) = c.tick(0.0, healthy(kv_usage=0.99, backlog_ratio=5.0))
    assert ev.reason == "kv_overload+cpu_overload"


def test_psi_only_when_enabled() -> None:
    s = healthy(psi_some_avg10=80.0)
    off = AimdController(CFG)
    off.tick(0.0, s)
    assert not off.cpu_overloaded and off.window == 31  # grew: nothing overloaded
    on = AimdController(AdmissionConfig(tuning=tuned(use_psi=True)))
    assert on.tick(0.0, s) == []  # CPU overload holds the window
    assert on.cpu_overloaded and on.window == 30
    # PSI 40 % is inside its band: still overloaded; 30 % leaves.
    on.tick(0.2, healthy(psi_some_avg10=40.0))
    assert on.cpu_overloaded
    on.tick(0.4, healthy(psi_some_avg10=30.0))
    assert not on.cpu_overloaded


def test_slow_growth_after_overload_when_used() -> None:
    c = AimdController(CFG)
    run(c, [healthy(kv_usage=0.95)] * 5)
    assert c.window == 4
    # Pressure gone, window fully used: +1 per tick, no faster.
    assert run(c, [healthy(admitted=30)] * 5, t0=10.0) == [5, 6, 7, 8, 9]
    assert not c.kv_overloaded


def test_growth_stops_at_max() -> None:
    c = AimdController(AdmissionConfig(window_init=28, window_max=30, tuning=TUNING))
    assert run(c, [healthy()] * 4) == [29, 30, 30, 30]
    assert c.ceiling == 30 and c.effective_limit == 30


def test_window_binds_only_while_overloaded() -> None:
    # Work conservation: without overload the count of admitted sessions holds nobody back;
    # overloaded, the window (cut from what the worker holds) does.
    c = AimdController(AdmissionConfig(window_init=10, tuning=TUNING))
    c.tick(0.0, healthy(admitted=3))
    assert c.window == 10 and c.effective_limit == NO_CEILING
    c.tick(0.2, healthy(kv_usage=0.95, admitted=40))
    assert c.kv_overloaded and c.window == 7 and c.effective_limit == c.cfg.window_min
    c.tick(0.4, healthy(kv_usage=0.87, admitted=40))  # in the band, still overloaded
    assert c.effective_limit == c.window == 4
    c.tick(0.6, healthy(kv_usage=0.8, admitted=40))
    assert not c.overloaded and c.effective_limit == NO_CEILING


def test_app_limited_guard() -> None:
    c = AimdController(CFG)
    run(c, [healthy(kv_usage=0.95)] * 5)
    assert c.window == 4
    # 3 admitted: 3 ≥ 0.5·4, 0.5·5, 0.5·6 → grow to 7; 3 < 0.5·7 → hold.
    assert run(c, [healthy(admitted=3)] * 6, t0=10.0) == [5, 6, 7, 7, 7, 7]


def test_no_growth_without_kv_budget() -> None:
    c = AimdController(AdmissionConfig(window_init=10, tuning=TUNING))
    assert run(c, [healthy(budget_blocks=0)] * 3) == [10, 10, 10]
    assert run(c, [healthy(budget_blocks=None)] * 2, t0=5.0) == [11, 12]  # no block counts


def test_hold_inside_band_from_below() -> None:
    c = AimdController(AdmissionConfig(window_init=10, tuning=TUNING))
    trace = [healthy(kv_usage=u) for u in (0.86, 0.89, 0.87, 0.8999, 0.86)]
    assert run(c, trace) == [10] * 5
    assert not c.kv_overloaded
    # CPU band: ratio 1.5 and wait 3 s are between leave and enter.
    assert run(c, [healthy(backlog_ratio=1.5), healthy(tool_wait_ema_s=3.0)], t0=5.0) == [10, 10]


def test_no_oscillation_inside_band_after_overload() -> None:
    c = AimdController(CFG)
    trace = [healthy(kv_usage=0.95)] + [healthy(kv_usage=u) for u in (0.86, 0.89, 0.87, 0.88)]
    windows = run(c, trace)
    # Still overloaded in the band (hysteresis): only decreases, never a step up.
    assert windows == [21, 14, 9, 6, 4]
    assert c.kv_overloaded
    # Only at or below the leave mark does the state flip, and growth resumes.
    assert run(c, [healthy(kv_usage=0.85)] * 2, t0=5.0) == [5, 6]
    assert not c.kv_overloaded


def test_cpu_overload_needs_both_marks_to_leave() -> None:
    c = AimdController(AdmissionConfig(window_init=20, tuning=TUNING))
    c.tick(0.0, healthy(backlog_ratio=2.5))
    c.tick(0.2, healthy(backlog_ratio=0.5, tool_wait_ema_s=3.0))  # wait above its leave mark
    assert c.cpu_overloaded and c.window == 20
    c.tick(0.4, healthy(backlog_ratio=0.5, tool_wait_ema_s=2.0))
    assert not c.cpu_overloaded and c.window == 21


@pytest.mark.parametrize(
    ("per_cpu", "tool_cpus", "cap"),
    [
        # The default: ceil(cpus · 4) clamped to [4, 30] (window_max 30 here); 0 CPUs means
        # unknown: no cap.
        (4.0, 0.0, 30), (4.0, 0.5, 4), (4.0, 1.0, 4), (4.0, 1.6, 7), (4.0, 2.0, 8),
        (4.0, 7.5, 30),
        # The backlog marks' mean: ceil(cpus · (1.0 + 2.0) / 2).
        (1.5, 1.0, 4), (1.5, 3.0, 5), (1.5, 8.0, 12), (1.5, 7.5, 12), (1.5, 100.0, 30),
    ],
)
def test_cpu_cap(per_cpu: float, tool_cpus: float, cap: int) -> None:
    c = AimdController(AdmissionConfig(window_max=30, tuning=tuned(cpu_cap_backlog=per_cpu)))
    c.tick(0.0, healthy(tool_cpus=tool_cpus, backlog_ratio=2.0))  # CPU overloaded
    assert c.cpu_cap == cap
    assert c.effective_limit == cap  # the window (30, held) does not bind


@pytest.mark.parametrize(
    ("usage", "cap"),
    [(0.0, NO_CEILING), (0.85, NO_CEILING), (0.88, NO_CEILING), (0.8999, NO_CEILING), (0.9, 4),
     (1.0, 4)],
)
def test_kv_cap_is_the_floor_from_the_high_mark(usage: float, cap: int) -> None:
    # Below the mark the KV fit's reserve keeps prompts out of the overload; at it, the floor.
    c = AimdController(CFG)
    c.tick(0.0, healthy(kv_usage=usage))
    assert c.kv_cap == cap


def test_cpu_cap_binds_only_while_cpu_is_overloaded() -> None:
    # 8 tool CPUs, cap ceil(8 · 1.5) = 12. Healthy CPUs: no cap, the window (20) rules.
    c = AimdController(AdmissionConfig(window_init=20, window_max=30,
                                       tuning=tuned(cpu_cap_backlog=1.5)))
    c.tick(0.0, healthy(tool_cpus=8.0, admitted=0))
    assert (c.cpu_cap, c.effective_limit) == (30, 30)
    # Overloaded (backlog 2.5 ≥ 2.0): the cap binds at once, below the held window (20).
    c.tick(0.2, healthy(tool_cpus=8.0, backlog_ratio=2.5, admitted=20))
    assert c.cpu_overloaded and (c.window, c.cpu_cap, c.effective_limit) == (20, 12, 12)
    # Overload left (ratio ≤ 1.0): the cap lifts; the window grows back on its own.
    c.tick(0.4, healthy(tool_cpus=8.0, backlog_ratio=0.5))
    assert not c.cpu_overloaded and c.cpu_cap == 30 and c.effective_limit == 30
    assert c.window == 21


def test_effective_limit_is_min_of_window_and_caps() -> None:
    c = AimdController(AdmissionConfig(window_init=20, window_max=30,
                                       tuning=tuned(cpu_cap_backlog=1.5)))
    # KV and CPU inside their bands: the window holds, the CPU cap binds (CPUs pressed).
    c.tick(0.0, healthy(kv_usage=0.86, tool_cpus=8.0, backlog_ratio=1.5, admitted=0))
    assert (c.window, c.kv_cap, c.cpu_cap, c.effective_limit) == (20, 30, 12, 12)
    c.tick(0.2, healthy(kv_usage=0.95, tool_cpus=100.0, admitted=20))
    assert (c.window, c.effective_limit) == (14, 4)  # the KV cap: the floor at the mark


@pytest.mark.parametrize(
    "signals",
    [healthy(stale=True), healthy(kv_usage=None), healthy(kv_usage=0.1, stale=True)],
)
def test_stale_counts_as_kv_overloaded(signals: ControlSignals) -> None:
    c = AimdController(CFG)
    c.tick(0.0, healthy(admitted=0))  # seen once
    (ev,) = c.tick(0.2, signals)
    assert ev.reason == "stale" and ev.new == 21
    assert c.kv_overloaded and c.stale
    assert c.kv_cap == 4 and c.effective_limit == 4


def test_a_worker_never_seen_is_held_at_the_floor_without_a_window_step() -> None:
    c = AimdController(CFG)
    assert c.tick(0.0, healthy(stale=True)) == [] and c.tick(0.2, healthy(stale=True)) == []
    assert c.stale and c.window == 30 and c.effective_limit == 4
    assert c.tick(0.4, healthy(kv_usage=0.95)) and c.window == 21  # seen, overloaded: cut


def test_control_interval_respected() -> None:
    c = AimdController(CFG)
    over = healthy(kv_usage=0.95)
    assert c.tick(0.0, over) and c.window == 21
    assert c.tick(0.1, over) == [] and c.window == 21
    assert c.tick(0.19, over) == [] and c.window == 21
    assert c.tick(0.2, over) and c.window == 14
    assert c.last_tick == 0.2


def test_a_worker_seen_after_a_stale_tick_gets_its_caps_at_once() -> None:
    """The interval paces window steps; a worker unseen at one tick (the floor) and seen
    before the interval is over gets its caps from the facts then. Its window's next step,
    and a worker going stale, still wait for the interval."""
    c = AimdController(CFG)
    c.tick(0.0, healthy(admitted=0))
    c.tick(0.2, healthy(stale=True))
    assert c.stale and c.effective_limit == 4 and c.window == 21
    assert c.tick(0.25, healthy(stale=True)) == [] and c.stale
    assert c.tick(0.3, healthy(kv_usage=0.1)) == []  # seen: caps now, no window step
    assert not c.stale and not c.kv_overloaded and c.effective_limit == NO_CEILING
    assert c.window == 21 and c.last_tick == 0.2
    assert c.tick(0.35, healthy(stale=True)) == [] and not c.stale  # going stale: paced
    (ev,) = c.tick(0.4, healthy(kv_usage=0.1))  # the interval's tick: the window's step
    assert ev.reason == "additive_increase" and c.window == 22 and c.last_tick == 0.4


def test_float_accumulated_ticks_are_not_skipped() -> None:
    c = AimdController(AdmissionConfig(window_init=4, tuning=TUNING))
    t = 0.0
    for _ in range(20):
        c.tick(t, healthy())
        t += 0.2  # 0.6000000000000001, 0.7999999999999999, ...
    assert c.window == 24
