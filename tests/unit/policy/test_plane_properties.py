"""The control plane under event sequences the gateway can produce (``gateway_model.py``).

Hypothesis draws a run (sessions reusing five ids; requests, final or not, of children too;
calls that end well, fail, answer or move; clients that leave while held for admission, in
the dispatch gate or just as they were admitted; ticks after any event, with time jumps past
holds, idle timeouts and the queue deadline; workers that go unhealthy or stale and come back;
``DELETE`` at any moment, the id reused while calls of the ended session run; leases lost to
another replica) against one and two workers, the ``mars`` and ``fcfs`` presets.
After every step the plane agrees with the gateway: each session the plane knows is in the
table, each confirmed slot is an admitted session's, each worker's in-flight and gated counts
are the calls the gateway has there, each session's count of requests in flight is the
gateway's (its own calls only, not those of an ended session of its id), a dormant session
holds no reservation past its session, the scheduler forgets a session once it and its last
call are over. At the end (every call over, every client gone, some dormant sessions' leases
lost, time past every hold) nothing is held anywhere, and no map keeps an entry for a session
that ended.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marsproxy.core.answers import ReplyKind
from marsproxy.core.session_record import SessionState
from marsproxy.policy.plane import Phase
from marsproxy.sim.invariants import check_drained
from tests.unit.policy.gateway_model import GatewayModel, Req

KEYS = [f"anon/id/s{i}" for i in range(5)]
CHARS = [400, 1600, 4000, 8000, 12000]
DTS = [0.05, 0.2, 1.0, 5.0, 30.0, 70.0, 200.0, 400.0]
REPLIES = [ReplyKind.TOOL_CALL, ReplyKind.ANSWER, None]

STEP = st.tuples(st.integers(0, 10), st.integers(0, 7), st.integers(0, 7))


def _pick(reqs: list[Req], a: int) -> Req | None:
    return reqs[a % len(reqs)] if reqs else None


def step(gw: GatewayModel, op: int, a: int, b: int) -> None:
    """One gateway event, read from three small integers."""
    if op <= 2:  # a request (the most common event)
        key = KEYS[a % len(KEYS)]
        parent = KEYS[(a + 1) % len(KEYS)] if b == 7 else None
        if parent is not None and gw.table.get(parent) is None:
            parent = None  # tree_identity: a parent is named only while live
        gw.request(key, final=b == 0, chars=CHARS[b % len(CHARS)], parent=parent)
    elif op == 3 and (r := _pick(gw.live("granted"), a)) is not None:
        gw.proceed(r, leave=b == 0, chars=CHARS[(a + b) % len(CHARS)], gate=b == 6)
    elif op in (4, 5) and (r := _pick(gw.live("running"), a)) is not None:
        gw.finish(r, ok=b != 0, reply=REPLIES[b % 3], moved=b == 5)
    elif op == 6 and (r := _pick(gw.live("held") + gw.live("gated"), a)) is not None:
        if r.state == "held":
            gw.leave_held(r)
        else:
            gw.leave_gate(r)
    elif op == 7:
        gw.tick(DTS[a])
    elif op == 8:
        gw.delete(KEYS[a % len(KEYS)])
    elif op == 9:
        w = gw.workers[f"w{a % gw.n_workers}"]
        w.healthy, w.stale = b % 4 != 1, b % 4 == 2
        w.kv_usage = [0.0, 0.3, 0.6, 0.95][b // 2]
        gw.tick(0.2)
    elif op == 10:
        gw.lost(KEYS[a % len(KEYS)])


def check(gw: GatewayModel) -> None:
    """The plane agrees with the gateway now."""
    p, core, sched = gw.plane, gw.plane.admission, gw.plane.scheduler
    for rec in core.sessions:
        assert gw.table.get(rec.key) is not None, f"{rec.key} ended in the table, not the plane"
    for key, worker in p._held.items():
        rec = core.sessions.get(key)
        assert rec is not None and rec.state is SessionState.ADMITTED and rec.worker == worker
    for w in gw.workers:
        running = [r for r in gw.live("running") if r.ticket is not None
                   and r.ticket.worker == w]
        gated = [r for r in gw.live("gated") if r.ticket is not None and r.ticket.worker == w]
        assert sched.in_flight(w) == len(running), f"in flight on {w}"
        assert sched.queue_length(w) == len(gated), f"gated on {w}"
    for rec in core.sessions:
        mine = [r for r in gw.reqs if r.key == rec.key and r.gen == gw.gens[rec.key]]
        states = {"held"} if rec.state is SessionState.QUEUED else {"granted", "gated",
                                                                   "running"}
        counted = sum(1 for r in mine if r.state in states)
        assert rec.in_flight == counted, (
            f"{rec.key} ({rec.state}) counts {rec.in_flight} requests in flight, the gateway"
            f" has {counted}")
    for r in sched.ledger.reservations():
        assert p.phase(r.session).value in ("dormant", "in_call"), (
            f"reservation of {r.session} ({p.phase(r.session)})")
    calls = {t.session for t in sched._by_call.values()}
    for key in sched._sessions:  # forgotten with its session (its last call's end, if later)
        assert p.phase(key) is not Phase.ENDED or key in calls, f"scheduler keeps {key}"


def drain(gw: GatewayModel) -> None:
    """Every call ends, every client is answered or leaves, the workers come back."""
    for w in gw.workers.values():
        w.healthy, w.stale, w.kv_usage = True, False, 0.0
    gw.tick(0.2)
    for _ in range(500):
        if r := _pick(gw.live("running"), 0):
            gw.finish(r, ok=True, reply=ReplyKind.TOOL_CALL, moved=False)
        elif r := _pick(gw.live("granted"), 0):
            gw.proceed(r, leave=False, chars=1600, gate=False)
        elif gw.live("gated"):
            at = gw.plane.scheduler.next_release_at()
            gw.tick(0.2 if at is None else max(0.2, at - gw.now))
            assert gw.live("running") or gw.live("granted") or at is not None, (
                "calls held in the gate while nothing runs")
        elif gw.live("held"):
            gw.tick(5.0)
            if gw.now > 10_000:
                pytest.fail("sessions wait for ever on idle workers")
        else:
            break
        check(gw)
    for key in KEYS[::2]:  # some dormant sessions move to another replica: nothing stays here
        gw.lost(key)
    check(gw)
    for key in KEYS:  # the clients are done: the table lets every session go
        gw.delete(key)
    for dt in (1.0, 100.0, 2000.0, 2000.0):
        gw.tick(dt)
    check(gw)


def leftovers(gw: GatewayModel) -> dict[str, int]:
    """Per-session state that must be gone once every session ended."""
    p, core, sched = gw.plane, gw.plane.admission, gw.plane.scheduler
    maps: dict[str, Any] = {
        "plane pending": p._pending, "plane held": p._held, "plane arrivals": p._arrival,
        "tree links": p.trees._parent, "tree children": p.trees._children,
        "watched answers": p.answers._watched,
        "scheduler sessions": sched._sessions, "attained service": sched.service._attained,
        "ledger": sched.ledger._by_session, "tickets": sched._by_call,
        "held-until": sched._held_until,
        "tool tracker sessions": p.tracker._sessions,
        "peak forecasts": core.peaks._sessions,
        "yields": core.yields._of, "away": core.yields._away,
        "tenant credits": core.queue.shares._credit,
        "estimator corrections": core.estimator._correction,
        "prefix maps": core.prefixes._maps,
        "gauge ended": core.gauge._ended,
        "idle deadlines": core.sessions._idle, "hold deadlines": core.sessions._holds,
    }
    out = {k: len(v) for k, v in maps.items() if len(v)}
    out.update({str(v): 1 for v in check_drained(core, sched, {})})
    return out


@settings(max_examples=250, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(["mars", "fcfs"]), n_workers=st.sampled_from([1, 2]),
       gated=st.booleans(), steps=st.lists(STEP, max_size=80))
def test_the_plane_stays_consistent_and_drains(
    policy: str, n_workers: int, gated: bool, steps: list[tuple[int, int, int]],
) -> None:
    gw = GatewayModel(policy, n_workers, gated)
    gw.tick(0.0)
    for op, a, b in steps:
        step(gw, op, a, b)
        check(gw)
    drain(gw)
    assert leftovers(gw) == {}
