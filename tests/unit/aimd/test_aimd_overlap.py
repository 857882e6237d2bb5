"""The measured overlap of forecast peaks, and the overcommit of the fit it allows
(``admission.tuning.peak_overcommit_max``, ``aimd/overlap.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from marsproxy.aimd.admission import AdmissionCore, DecisionKind, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig, AdmissionTuning
from marsproxy.aimd.overlap import OverlapTracker


def tracker(**cfg: Any) -> OverlapTracker:
    base: dict[str, Any] = dict(peak_overcommit=1.0, peak_overcommit_max=3.0,
                                peak_overlap_target=0.8, peak_overlap_min_sessions=4,
                                peak_overlap_min_fill=0.5, peak_history=4)
    base.update(cfg)
    return OverlapTracker(_config(base), ["w0"])


def read(t: OverlapTracker, now: float, used: int, *, committed: int = 800, usable: int = 900,
         sessions: int = 6, preemptions: float | None = 0.0, tasks: bool = False) -> None:
    t.observe(now, "w0", used_blocks=used, committed_blocks=committed, usable_blocks=usable,
              sessions=sessions, preemptions_total=preemptions, tasks=tasks)


def test_starts_strict_and_does_not_decay_before_a_session_has_finished() -> None:
    t = tracker()
    assert t.overlap("w0") == 1.0 and t.factor("w0") == 1.0  # 0.8 / 1 clamped to the floor
    for i in range(50):
        read(t, i * 0.2, used=100)
    assert t.overlap("w0") == 1.0 and t.lifetime_s is None


def test_a_session_gone_quiet_starts_the_decay_until_one_runs_its_course() -> None:
    t = tracker()
    t.went_quiet("s1", admitted_at=2.0, last_active=8.0)  # admitted 6 s until its last call
    assert t.lifetime_s == pytest.approx(6.0)
    t.went_quiet("s2", admitted_at=0.0, last_active=100.0)  # a pace is known: no more guesses
    assert t.lifetime_s == pytest.approx(6.0)
    read(t, 0.0, used=100)
    read(t, 6.0, used=100)
    assert t.overlap("w0") == pytest.approx(0.5)
    t.session_lived(30.0)  # one that ran its course counts beside it
    assert t.lifetime_s == pytest.approx(18.0)


def test_a_session_quiet_in_a_tool_it_reported_is_not_taken_for_done() -> None:
    # Its client said a tool runs: the task goes on (a long tool phase, not a finished task),
    # and its time admitted so far would pace the decay far too fast.
    t = tracker()
    t.in_reported_tool = {"busy"}.__contains__
    t.went_quiet("busy", admitted_at=2.0, last_active=8.0)
    assert t.lifetime_s is None
    t.went_quiet("done", admitted_at=2.0, last_active=8.0)
    assert t.lifetime_s == pytest.approx(6.0)


def test_decays_by_half_per_session_lifetime_down_to_what_is_held() -> None:
    t = tracker()
    t.session_lived(10.0)
    read(t, 0.0, used=200)  # the first reading sets the clock: no decay yet
    assert t.overlap("w0") == 1.0
    read(t, 10.0, used=200)  # one lifetime later: halved
    assert t.overlap("w0") == pytest.approx(0.5)
    assert t.factor("w0") == pytest.approx(1.6)  # 0.8 / 0.5
    read(t, 30.0, used=200)  # two more: 0.125, but the sessions hold 200 / 800 now
    assert t.overlap("w0") == pytest.approx(0.25)
    assert t.factor("w0") == pytest.approx(3.0)  # 0.8 / 0.25 = 3.2, clamped to the ceiling
    read(t, 30.2, used=720)  # they grew: the maximum follows at once
    assert t.overlap("w0") == pytest.approx(0.9)
    assert t.factor("w0") == 1.0


def test_an_overlap_decayed_to_nothing_gives_the_ceiling() -> None:
    t = tracker()
    t.session_lived(1e-3)
    for i in range(2000):  # sessions that hold nothing, for a million lifetimes
        read(t, float(i), used=0)
    assert t.overlap("w0") == 0.0 and t.factor("w0") == 3.0


def test_lifetime_is_the_mean_of_the_last_peak_history_sessions() -> None:
    t = tracker(peak_history=2)
    for s in (100.0, 4.0, 6.0):
        t.session_lived(s)
    assert t.lifetime_s == pytest.approx(5.0)


@pytest.mark.parametrize("kw", [
    {"sessions": 3},  # fewer than peak_overlap_min_sessions: chance decides their overlap
    {"committed": 400},  # forecasts fill under half the usable blocks
])
def test_readings_that_say_nothing_neither_count_nor_let_it_decay(kw: dict[str, Any]) -> None:
    t = tracker()
    t.session_lived(1.0)
    for i in range(20):
        read(t, float(i), used=10, **kw)
    assert t.overlap("w0") == 1.0


def test_a_preemption_resets_it_and_a_restarted_engine_does_not() -> None:
    t = tracker()
    t.session_lived(1.0)
    read(t, 0.0, used=100, preemptions=5.0)
    read(t, 10.0, used=100, preemptions=5.0)
    assert t.overlap("w0") == pytest.approx(0.125)
    read(t, 10.2, used=100, preemptions=6.0)
    assert t.overlap("w0") == 1.0 and t.factor("w0") == 1.0
    read(t, 20.0, used=100, preemptions=6.0)
    low = t.overlap("w0")
    assert low < 0.2
    read(t, 20.2, used=100, preemptions=0.0)  # the counter went back: a new engine
    assert t.overlap("w0") <= low


def test_a_preemption_while_one_shot_tasks_run_does_not_reset_it() -> None:
    # A batch client's tasks beside the sessions: the engine preempts the latest-started calls,
    # theirs, whatever the fit does. Rises while they run move the baseline; one after is read.
    t = tracker()
    t.session_lived(1.0)
    read(t, 0.0, used=100, preemptions=5.0)
    read(t, 10.0, used=100, preemptions=5.0)
    low = t.overlap("w0")
    assert low == pytest.approx(0.125)
    read(t, 10.2, used=100, preemptions=9.0, tasks=True)
    assert t.overlap("w0") <= low
    read(t, 10.4, used=100, preemptions=9.0)  # no rise since the last reading
    assert t.overlap("w0") <= low
    read(t, 10.6, used=100, preemptions=10.0)
    assert t.overlap("w0") == 1.0


def test_no_preemption_counter_no_reading() -> None:
    t = tracker()
    t.session_lived(1.0)
    for i in range(20):
        read(t, float(i), used=10, preemptions=None)
    assert t.overlap("w0") == 1.0


def test_a_ceiling_at_the_floor_keeps_a_fixed_factor() -> None:
    t = tracker(peak_overcommit=1.2, peak_overcommit_max=1.0)
    t.session_lived(1.0)
    for i in range(20):
        read(t, float(i), used=10)
    assert t.factor("w0") == 1.2


# -- through the admission core --------------------------------------------------------------
FIRST = 100 * 16  # forecasts of 200 blocks (growth 2): four fill 800 of the 900 usable


def sig(**kw: Any) -> WorkerSignals:
    base: dict[str, Any] = dict(kv_usage=0.2, free_blocks=800, total_blocks=1000, block_size=16,
                                running=1, preemptions_total=0.0)
    base.update(kw)
    return WorkerSignals(**base)


def core(**cfg: Any) -> AdmissionCore:
    base: dict[str, Any] = dict(window_init=30, window_min=2, window_max=30, kv_reserve_frac=0.1,
                                peak_growth_prior=2.0, peak_min_samples=100,
                                peak_free_sessions=0, idle_admit=False, peak_history=8)
    base.update(cfg)
    c = AdmissionCore(_config(base), ["w0"])
    c.tick(0.0, {"w0": sig()})
    return c


def fill(c: AdmissionCore, n: int, at: float = 0.1) -> list[str]:
    """Offer ``n`` sessions; return those admitted at once."""
    return [f"s{i}" for i in range(n)
            if c.on_request(at, f"s{i}", "t", FIRST).kind is DecisionKind.ADMITTED]


def first_runs_its_course(c: AdmissionCore, end: float) -> None:
    """s0 makes its final call and ends at ``end``: the lifetime the overlap decays by."""
    c.on_response_end(1.0, "s0", prompt_tokens=FIRST)
    c.on_request(1.0, "s0", "t", FIRST, final=True)
    c.on_response_end(end, "s0", prompt_tokens=FIRST)


def test_sessions_seen_holding_little_let_the_fit_admit_more() -> None:
    c = core()
    assert fill(c, 6) == ["s0", "s1", "s2", "s3"]  # the strict fit: four forecasts
    first_runs_its_course(c, 5.0)  # admitted at 0.1: lived 4.9 s
    assert c.overlaps.lifetime_s == pytest.approx(4.9)
    # s1-s3 and the one admitted in s0's place hold 20 % of the blocks (in tool phases).
    assert c.sessions.admitted_on("w0") == 4
    before = c.peak_room("w0")
    for k in range(1, 60):
        acts = c.tick(5.0 + 0.2 * k, {"w0": sig(kv_usage=0.2, free_blocks=800)})
        if acts.admitted:
            break
    assert acts.admitted, "the measured overlap never let a fifth session in"
    assert c.sessions.admitted_on("w0") == 5
    assert c.overlaps.factor("w0") > 1.0
    assert before == 50  # (900 usable - 800 forecast) / growth 2: a 100-block prompt did not fit


def test_a_plain_clients_session_quiet_past_its_hold_lets_the_overlap_decay() -> None:
    # No final flag: nothing ends before the idle timeout (a minute), yet a session silent past
    # its KV hold (20 s, no tool history) is likely done: its time admitted paces the decay.
    c = core()
    assert fill(c, 6) == ["s0", "s1", "s2", "s3"]
    c.on_response_end(1.1, "s0", prompt_tokens=FIRST)  # s0's one call; it never returns
    for k in range(1, 20):  # the others' calls run on, holding 20 % of the blocks
        c.tick(1.0 * k, {"w0": sig(kv_usage=0.2, free_blocks=800)})
    assert c.overlaps.lifetime_s is None and c.overlaps.overlap("w0") == 1.0
    for k in range(20, 60):
        c.tick(1.0 * k, {"w0": sig(kv_usage=0.2, free_blocks=800)})
    assert c.overlaps.lifetime_s == pytest.approx(1.0)  # admitted at 0.1, last call to 1.1
    assert c.overlaps.factor("w0") > 1.0
    assert c.sessions.get("s0") is not None  # still admitted: only its idle timeout ends it


def test_a_preemption_puts_the_strict_fit_back() -> None:
    c = core()
    fill(c, 5)
    first_runs_its_course(c, 2.0)
    for k in range(1, 40):
        c.tick(2.0 + 0.2 * k, {"w0": sig(kv_usage=0.2, free_blocks=800)})
    assert c.overlaps.factor("w0") > 1.0
    c.tick(20.0, {"w0": sig(kv_usage=0.2, free_blocks=800, preemptions_total=3.0)})
    assert c.overlaps.factor("w0") == 1.0
    # Room for no more than the strict fit allows: the forecasts of those held fill it.
    room = c.peak_room("w0")
    assert room is not None and room < 100


def test_a_worker_that_reports_no_preemption_counter_keeps_the_strict_fit() -> None:
    # The counter is the safety net of the overcommit: without it, none is taken.
    c = core()
    fill(c, 5)
    first_runs_its_course(c, 2.0)
    for k in range(1, 40):
        c.tick(2.0 + 0.2 * k, {"w0": sig(kv_usage=0.2, free_blocks=800, preemptions_total=None)})
    assert c.overlaps.overlap("w0") == 1.0 and c.overlaps.factor("w0") == 1.0


def _config(flat: dict[str, Any]) -> AdmissionConfig:
    """``flat`` keys of both levels: the tuning ones go under ``tuning``."""
    tuned = {k: v for k, v in flat.items() if k in AdmissionTuning.model_fields}
    rest = {k: v for k, v in flat.items() if k not in tuned}
    return AdmissionConfig(**rest, tuning=AdmissionTuning(**tuned))
