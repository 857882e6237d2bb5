"""Session lifecycle: QUEUED → ADMITTED (LLM/TOOL) → ENDED, and idle timeouts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marsproxy.core.lifecycle import SessionLifecycle
from marsproxy.core.session_record import EndReason, LifecycleError, Phase, SessionState


def table() -> SessionLifecycle:
    return SessionLifecycle(return_history=16, one_shot_crowd=32, idle_factor=4.0, idle_min_s=60.0,
                            idle_max_s=1800.0, hold_reprefill_factor=0.0)


def test_full_life() -> None:
    t = table()
    rec = t.queue(0.0, "s", "tenant", 500, long=False)
    assert rec.state is SessionState.QUEUED and rec.in_flight == 1
    rec = t.admit(2.0, "s", "w0")
    assert rec.state is SessionState.ADMITTED and rec.worker == "w0" and rec.admitted_at == 2.0
    assert t.admitted_on("w0") == 1 and t.sessions_on("w0") == ["s"]
    rec = t.response_end(5.0, "s", usual_tool_s=30.0)
    assert rec.phase is Phase.TOOL and rec.in_flight == 0 and rec.idle_timeout_s == 120.0
    rec = t.request(40.0, "s")
    assert rec.phase is Phase.LLM and rec.turns == 2 and rec.idle_deadline() is None
    t.response_end(45.0, "s", usual_tool_s=None)
    assert rec.idle_deadline() == 45.0 + 60.0  # no tool history: the floor
    ended = t.end(50.0, "s", EndReason.DELETED)
    assert ended is not None
    assert ended is rec and rec.state is SessionState.ENDED
    assert rec.end_reason is EndReason.DELETED
    assert t.admitted_on("w0") == 0 and t.get("s") is None and len(t) == 0
    assert t.end(51.0, "s", EndReason.DELETED) is None


def test_idle_expiry_only_without_requests_in_flight() -> None:
    t = table()
    t.queue(0.0, "a", "t", 1, long=False)
    t.admit(0.0, "a", "w0")
    assert t.idle_expired(10_000.0) == []  # its first request is still in flight
    t.response_end(10.0, "a", usual_tool_s=20.0)  # timeout 80 s
    assert t.idle_expired(89.9) == []
    assert [r.key for r in t.idle_expired(90.0)] == ["a"]
    t.request(90.0, "a")
    assert t.idle_expired(1000.0) == []


def test_queued_sessions_never_idle_out() -> None:
    t = table()
    t.queue(0.0, "q", "t", 1, long=False)
    assert t.idle_expired(10**6) == []


def test_long_sessions_counted_per_worker() -> None:
    t = table()
    t.queue(0.0, "l", "t", 90_000, long=True)
    t.queue(0.0, "s", "t", 10, long=False)
    t.admit(1.0, "l", "w0")
    t.admit(1.0, "s", "w0")
    assert t.long_on("w0") == 1 and t.admitted_on("w0") == 2
    t.end(2.0, "l", EndReason.FINAL)
    assert t.long_on("w0") == 0 and t.admitted_on("w0") == 1


def test_waiters_and_final_flag() -> None:
    t = table()
    t.queue(0.0, "s", "t", 1, long=False)
    t.add_waiter("s", final=True)
    rec = t.admit(1.0, "s", "w0")
    assert rec.in_flight == 2 and rec.turns == 2 and rec.final
    rec = t.response_end(2.0, "s", None)
    assert rec.phase is Phase.LLM  # one still in flight
    rec = t.response_end(3.0, "s", None)
    assert rec.phase is Phase.TOOL


def test_ending_a_queued_session_frees_nothing() -> None:
    t = table()
    t.queue(0.0, "s", "t", 1, long=False)
    rec = t.end(5.0, "s", EndReason.QUEUE_DEADLINE)
    assert rec is not None and rec.worker is None and rec.end_reason is EndReason.QUEUE_DEADLINE


def test_invalid_transitions() -> None:
    t = table()
    with pytest.raises(LifecycleError):
        t.admit(0.0, "nobody", "w0")
    t.queue(0.0, "s", "t", 1, long=False)
    with pytest.raises(LifecycleError):
        t.queue(0.0, "s", "t", 1, long=False)
    with pytest.raises(LifecycleError):
        t.request(0.0, "s")  # not admitted yet: continuations come after admission
    with pytest.raises(LifecycleError):
        t.response_end(0.0, "s", None)
    t.admit(0.0, "s", "w0")
    with pytest.raises(LifecycleError):
        t.admit(0.0, "s", "w1")
    with pytest.raises(LifecycleError):
        t.add_waiter("s")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(
    st.floats(0.0, 50.0), st.sampled_from(["req", "resp", "end"]), st.integers(0, 5),
    st.one_of(st.none(), st.floats(0.0, 100.0)),
), max_size=60))
def test_idle_index_matches_a_full_scan(ops: list[tuple[float, str, int, float | None]]) -> None:
    t = table()
    now = 0.0
    for dt, kind, n, usual in ops:
        now += dt
        key = f"s{n}"
        rec = t.get(key)
        if kind == "req":
            if rec is None:
                t.queue(now, key, "t", 1, long=False)
                t.admit(now, key, "w0")
            else:
                t.request(now, key)
        elif kind == "resp" and rec is not None and rec.in_flight > 0:
            t.response_end(now, key, usual)
        elif kind == "end":
            t.end(now, key, EndReason.DELETED)
        brute = sorted(
            r.key for r in t if (d := r.idle_deadline()) is not None and now >= d
        )
        assert sorted(r.key for r in t.idle_expired(now)) == brute


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(
    st.floats(0.0, 5.0), st.sampled_from(["new", "req", "resp", "end", "move"]),
    st.integers(0, 6), st.sampled_from(["w0", "w1"]),
), max_size=80))
def test_activity_index_matches_a_full_scan(ops: list[tuple[float, str, int, str]]) -> None:
    # active_on and dormant_since keep per-worker indexes; a full scan is the reference.
    t = table()
    now = 0.0
    for dt, kind, n, worker in ops:
        now += dt
        key = f"s{n}"
        rec = t.get(key)
        if kind == "new" and rec is None:
            t.queue(now, key, "t", 1, long=False)
            t.admit(now, key, worker)
        elif kind == "req" and rec is not None:
            t.request(now, key)
        elif kind == "resp" and rec is not None and rec.in_flight > 0:
            t.response_end(now, key, None)
        elif kind == "end":
            t.end(now, key, EndReason.DELETED)
        elif kind == "move" and rec is not None:
            t.move(key, worker)
        for w in ("w0", "w1"):
            on = [r for r in t if r.worker == w]
            assert t.active_on(w) == sum(1 for r in on if r.in_flight > 0)
            dormant = None if not on or any(r.in_flight > 0 for r in on) else max(
                0.0, max(r.last_active for r in on))
            assert t.dormant_since(w) == dormant


def _held_lifecycle(idle_min_s: float = 60.0, crowd: int = 32) -> SessionLifecycle:
    """Holds of at least 20 s; a tenant's record of its latest 16 first gaps."""
    return SessionLifecycle(idle_factor=4.0, idle_min_s=idle_min_s, idle_max_s=1800.0,
                            hold_min_s=20.0, return_history=16, one_shot_crowd=crowd,
                            hold_reprefill_factor=0.0)


def _dormant_after_first_call(t: SessionLifecycle, key: str, at: float) -> None:
    t.queue(at, key, "t", 500, long=False)
    t.admit(at, key, "w0")
    t.response_end(at + 1.0, key, usual_tool_s=None)


def test_a_first_call_holds_kv_room_only_where_its_tenants_sessions_come_back() -> None:
    t = _held_lifecycle()
    _dormant_after_first_call(t, "a", 0.0)  # nothing seen of tenant t yet: not held
    a = t.get("a")
    assert a is not None and not a.kv_held and a.first_gap and t.held_on("w0") == 0
    t.request(5.0, "a")  # back within its hold: tenant t's sessions come back
    assert not a.first_gap and a.kv_held and t.returns.rates() == {"t": (1, 1, 0)}
    _dormant_after_first_call(t, "b", 6.0)
    b = t.get("b")
    assert b is not None and b.kv_held and t.held_on("w0") == 2  # a in a call, b held
    t.response_end(8.0, "a", usual_tool_s=None)  # a's second gap: held whatever the tally
    assert a.kv_held and not a.first_gap
    # b stays away past its hold (7 + 20 s): released, and counted as not come back.
    assert [r.key for r in t.hold_expired(27.5)] == ["b"]
    assert not b.kv_held and t.returns.rates() == {"t": (1, 2, 0)}


def test_a_first_gap_not_held_is_still_watched_until_its_hold_would_end() -> None:
    t = _held_lifecycle()
    _dormant_after_first_call(t, "a", 0.0)
    assert [r.key for r in t.hold_expired(21.5)] == ["a"]  # it did not come back in time:
    assert t.returns.rates() == {"t": (0, 1, 0)} and t.load_on("w0") == 0  # no slot now
    t.request(30.0, "a")  # later: nothing more recorded
    assert t.returns.rates() == {"t": (0, 1, 0)}


def test_a_final_first_call_is_no_gap() -> None:
    # One call that says it is the last: it never goes dormant, so it says nothing of whether
    # its tenant's other sessions come back after a first call.
    t = table()
    t.queue(0.0, "s", "t", 500, long=False, final=True)
    t.admit(0.0, "s", "w0")
    rec = t.response_end(1.0, "s", usual_tool_s=None)
    assert not rec.first_gap
    t.end(1.0, "s", EndReason.FINAL)
    assert t.returns.rates() == {}


@pytest.mark.parametrize(("reason", "counted"), [
    (EndReason.IDLE_TIMEOUT, True), (EndReason.DELETED, True), (EndReason.MOVED, False)])
def test_a_first_gap_that_ends_did_not_come_back(reason: EndReason, counted: bool) -> None:
    # An idle timeout shorter than the hold ends it first (no hold deadline is kept then).
    t = _held_lifecycle(idle_min_s=10.0)
    _dormant_after_first_call(t, "a", 0.0)
    assert t.returns.rates() == {"t": (0, 0, 1)}
    t.end(11.0, "a", reason)  # moved or not, it is no longer in its first gap
    assert t.returns.rates() == ({"t": (0, 1, 0)} if counted else {})


def test_a_crowd_of_first_gaps_none_back_frees_the_next_ones_slots() -> None:
    # A batch client's tasks pile up in their first gap within a second: once 3 are open and
    # none of the tenant's sessions came back, its tenant is one-shot, and first gaps from the
    # third on hold no slot (the earlier ones keep theirs until their hold passes). The first
    # return ends it: later first gaps keep their slot again.
    t = _held_lifecycle(crowd=3)
    for i in range(2):
        _dormant_after_first_call(t, f"s{i}", 0.1 * i)
    assert not t.returns.one_shot("t") and t.load_on("w0") == 2  # watched, both
    _dormant_after_first_call(t, "s2", 0.2)
    assert t.returns.rates() == {"t": (0, 0, 3)} and t.returns.one_shot("t")
    _dormant_after_first_call(t, "s3", 0.5)
    assert t.load_on("w0") == 2 and t.slotless_on("w0") == 2
    t.request(2.0, "s0")  # back: the tenant's sessions come back after all
    assert not t.returns.one_shot("t") and t.returns.rates() == {"t": (1, 1, 3)}
    _dormant_after_first_call(t, "s4", 2.5)
    assert t.get("s4").kv_held  # type: ignore[union-attr]  # 1 of 1 came back: held
    assert [r.key for r in t.hold_expired(30.0)][-1] == "s4"
    assert t.returns.rates() == {"t": (1, 5, 0)}


def test_a_first_gap_not_held_is_still_load_for_placement() -> None:
    t = _held_lifecycle()
    _dormant_after_first_call(t, "a", 0.0)
    assert (t.held_on("w0"), t.load_on("w0")) == (0, 1)
    t.move("a", "w1")  # (as the core moves one not served yet)
    assert (t.load_on("w0"), t.load_on("w1")) == (0, 1)
    t.request(5.0, "a")  # back: held, and still load
    assert (t.held_on("w1"), t.load_on("w1")) == (1, 1)
    t.response_end(6.0, "a", usual_tool_s=None)  # second gap: held (its kind comes back now)
    _dormant_after_first_call(t, "b", 6.0)
    assert (t.held_on("w1"), t.load_on("w1"), t.load_on("w0")) == (1, 1, 1)
    t.end(7.0, "b", EndReason.IDLE_TIMEOUT)
    assert t.load_on("w0") == 0
    _dormant_after_first_call(t, "c", 8.0)  # 1 of 2 came back (a, not b): c is held
    assert t.get("c").kv_held  # type: ignore[union-attr]
    assert t.hold_expired(30.0) and t.load_on("w0") == 0 and t.load_on("w1") == 0


def test_a_first_gap_released_early_stays_load_until_it_ends() -> None:
    # Held (its tenant's sessions come back), then released early (it waits on its children):
    # no longer held, still load, and the counts come back to zero when it ends.
    t = _held_lifecycle()
    t.returns.record("t", True)
    _dormant_after_first_call(t, "p", 0.0)
    assert (t.held_on("w0"), t.load_on("w0")) == (1, 1)
    assert t.release_hold("p")
    assert (t.held_on("w0"), t.load_on("w0")) == (0, 1)
    t.end(5.0, "p", EndReason.IDLE_TIMEOUT)
    assert (t.held_on("w0"), t.load_on("w0")) == (0, 0)
    assert t.returns.rates() == {"t": (1, 2, 0)}


def test_a_hold_cut_short_by_a_cheap_prefix_keeps_the_sessions_slot_until_the_full_hold() -> None:
    # Tool history 0.1 s (4 × 0.1 s), a prefix that re-prefills in 0.25 s: its KV room goes
    # after 4 × 0.25 s, its slot (the load placement and the window count) after the 20 s floor.
    t = SessionLifecycle(idle_factor=4.0, idle_min_s=60.0, idle_max_s=1800.0, hold_min_s=20.0,
                         return_history=16, one_shot_crowd=32, hold_reprefill_factor=4.0)
    t.returns.record("t", True)
    t.queue(0.0, "a", "t", 500, long=False)
    t.admit(0.0, "a", "w0")
    t.response_end(0.5, "a", usual_tool_s=None)
    t.request(0.6, "a")  # back: past its first gap
    t.response_end(1.0, "a", usual_tool_s=0.1, reprefill_s=0.25)
    a = t.get("a")
    assert a is not None and a.kv_held and a.slot_until == 21.0
    assert [r.key for r in t.hold_expired(2.01)] == ["a"]
    assert not a.kv_held and t.held_on("w0") == 0 and t.load_on("w0") == 1
    assert [r.key for r in t.hold_expired(21.01)] == ["a"]
    assert t.load_on("w0") == 0 and t.admitted_on("w0") == 1  # admitted still, no slot
    t.request(25.0, "a")  # back: it holds both again, the cut-short deadline forgotten
    assert a.kv_held and a.slot_until is None and t.load_on("w0") == 1


def test_placements_are_counted_on_the_worker_a_session_ends_up_on() -> None:
    t = table()
    t.queue(0.0, "a", "t", 500, long=False)
    t.admit(0.0, "a", "w0")
    t.move("a", "w1")  # before its first call was served
    t.queue(0.0, "b", "t", 500, long=False)
    t.admit(0.0, "b", "w1")
    assert (t.placed_on("w0"), t.placed_on("w1")) == (0, 2)
    t.end(1.0, "a", EndReason.FINAL)
    assert t.placed_on("w1") == 2  # a count of placements, not of sessions there now
