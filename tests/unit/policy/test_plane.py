"""The control plane on its own: a session's phases, store answers, the pending deadline."""

from __future__ import annotations

import dataclasses

from marsproxy.aimd.admission import DecisionKind
from marsproxy.config import load_config
from marsproxy.core.session_record import EndReason
from marsproxy.policy.log import DecisionLog
from marsproxy.policy.observe import WorkerObservation
from marsproxy.policy.plane import ControlPlane, Phase
from marsproxy.sched.tickets import Ticket

FRESH = WorkerObservation(healthy=True, stale=False, kv_usage=0.0, total_blocks=1000,
                          block_size=16, running=0, sampled_at=0.0)


def _plane(**admission: object) -> tuple[ControlPlane, DecisionLog]:
    cfg = load_config(None, environ={}, overrides={
        "workers": ["http://a:1", "http://b:1"], "admission": admission})
    log = DecisionLog()
    return ControlPlane(cfg, ["a", "b"], tool_cpus=4.0, log=log), log


def test_a_session_goes_through_its_phases() -> None:
    plane, log = _plane()
    assert plane.wants_tick("s")  # nothing observed yet: tick before deciding
    plane.tick(0.0, {"a": FRESH, "b": FRESH}, at=0.0, cpu=None)
    assert not plane.wants_tick("s")
    ans = plane.request(0.1, "s", "t", chars=400)
    assert ans.kind is DecisionKind.ADMITTED and ans.outcome.proposed == ["s"]
    assert plane.phase("s") is Phase.PENDING and plane.held("s") is None
    p = plane.confirm(0.2, "s")
    assert p is not None and p.worker == ans.worker and plane.held("s") == ans.worker
    assert plane.phase("s") is Phase.IN_CALL
    t = plane.call_start(0.2, "s", p.worker, chars=400, max_new_tokens=10)
    assert t is not None  # the mars preset schedules every call
    end = plane.call_end(0.5, "s", t, incarnation=ans.incarnation, ok=True, admitted=True,
                         prompt_tokens=100, completion_tokens=10, chars=400, continues=True)
    assert end.result is not None and plane.phase("s") is Phase.DORMANT
    out = plane.session_end(0.6, "s", EndReason.DELETED)
    assert [e.worker for e in out.ended] == [p.worker]  # its slot to release
    assert plane.phase("s") is Phase.ENDED and plane.held("s") is None
    assert [e.kind for e in log.entries] == ["admit", "level", "retain", "end"]


def test_an_unconfirmed_session_expires_at_the_queue_deadline() -> None:
    plane, log = _plane(queue_deadline_s=50.0)
    plane.tick(0.0, {"a": FRESH, "b": FRESH}, at=0.0, cpu=None)
    plane.request(1.0, "s", "t", chars=400)  # the store never answers
    assert plane.tick(50.9, {}, at=50.9, cpu=None).expired == []
    out = plane.tick(51.0, {}, at=51.0, cpu=None)
    assert [(e.session, e.status, e.reason) for e in out.expired] == [
        ("s", 503, "queue_deadline")]
    assert [e.pending is not None for e in out.ended] == [True]  # withdraw the store's ask
    assert plane.phase("s") is Phase.ENDED and plane.pending_count == 0
    assert ("refuse", "s", ("queue_deadline",)) in [(e.kind, e.session, e.detail)
                                                    for e in log.entries]


def test_a_lost_lease_moves_the_session_out_without_a_release() -> None:
    plane, _ = _plane()
    plane.tick(0.0, {"a": FRESH, "b": FRESH}, at=0.0, cpu=None)
    ans = plane.request(0.1, "s", "t", chars=400)
    assert ans.worker is not None
    plane.confirm(0.1, "s")
    assert plane.lost(0.2, "s", "elsewhere").ended == []  # not the worker it holds: ignored
    out = plane.lost(0.3, "s", ans.worker)
    assert [(e.reason, e.worker) for e in out.ended] == [(EndReason.MOVED, None)]


def test_a_session_another_replica_admitted_first_is_confirmed_on_that_worker() -> None:
    plane, log = _plane()
    plane.tick(0.0, {"a": FRESH, "b": FRESH}, at=0.0, cpu=None)
    ans = plane.request(0.1, "s", "t", chars=400)
    other = "b" if ans.worker == "a" else "a"
    p = plane.confirm(0.2, "s", other)  # the store: its lease is on the other worker
    assert p is not None and p.worker == other and plane.held("s") == other
    rec = plane.admission.sessions.get("s")
    assert rec is not None and rec.worker == other
    assert plane.admission.sessions.admitted_on(other) == 1
    assert plane.admission.sessions.admitted_on(str(ans.worker)) == 0
    out = plane.session_end(0.3, "s", EndReason.DELETED)
    assert [e.worker for e in out.ended] == [other]
    assert ("admit", "s", (other,)) in [(e.kind, e.session, e.detail) for e in log.entries]


def test_admission_off_places_and_holds_at_once() -> None:
    plane, log = _plane(enabled=False)
    ans = plane.request(0.0, "s", "t", chars=400)
    assert ans.kind is DecisionKind.ADMITTED and ans.outcome.proposed == []
    assert plane.held("s") == ans.worker and log.entries[0].kind == "admit"


def test_a_parent_admitted_on_another_replica_makes_a_child_ranked_first() -> None:
    plane, _ = _plane()
    plane.tick(0.0, {"a": FRESH, "b": FRESH}, at=0.0, cpu=None)
    plane.request(0.1, "plain", "t", chars=400, cls="batch")
    plane.request(0.2, "kid", "t", chars=400, parent="elsewhere", parent_elsewhere=True)
    plane.request(0.3, "orphan", "t", chars=400, parent="gone")  # unknown anywhere: plain
    pending = dict(plane.pending())
    assert pending["kid"].child and not pending["orphan"].child
    assert pending["plain"].cls == "batch" and pending["plain"].tenant == "t"
    keys = plane.rank_keys({"t": 0.0})
    assert keys["kid"].band == 0 and keys["orphan"].band == 1 and keys["plain"].band == 2


def test_a_batch_sessions_calls_run_after_an_interactive_ones() -> None:
    plane, _ = _plane()
    for w in ("a", "b"):
        plane.scheduler.set_mode(w, "priority")
    plane.tick(0.0, {"a": FRESH, "b": FRESH}, at=0.0, cpu=None)
    prios = {}
    for key, cls in (("i", "interactive"), ("b", "batch")):
        ans = plane.request(0.1, key, "t", chars=400, cls=cls)
        p = plane.confirm(0.2, key)
        assert ans.kind is DecisionKind.ADMITTED and p is not None
        t = plane.call_start(0.2, key, p.worker, chars=400, max_new_tokens=10)
        assert t is not None and t.priority is not None
        assert t.gated is (cls == "batch")  # a later class's calls wait in the gate
        prios[key] = t.priority
    assert prios["i"] < prios["b"]  # lower runs sooner
    assert plane.scheduler.yield_rank("b") == 1
    plane.session_end(0.3, "b", EndReason.DELETED)
    assert plane.scheduler.yield_rank("b") == 0  # nothing kept of an ended session


def test_the_gate_knows_a_one_shot_keys_sessions() -> None:
    # The dispatch gate holds a one-shot task's call by the cap alone, yielding or not: it asks
    # the plane (Yields.first_class_task) which sessions will not grow (their key's sessions
    # never return) and are of the first class.
    plane, _ = _plane()
    plane.tick(0.0, {"a": FRESH, "b": FRESH}, at=0.0, cpu=None)
    for _ in range(16):
        plane.admission.sessions.returns.record("batch", False)
    plane.admission.sessions.returns.record("agents", True)
    for key, tenant in (("task", "batch"), ("agent", "agents")):
        assert plane.request(0.1, key, tenant, chars=400).kind is DecisionKind.ADMITTED
        assert plane.confirm(0.2, key) is not None
    assert plane.request(0.1, "later", "batch", chars=400, cls="batch").kind is (
        DecisionKind.ADMITTED)
    assert plane.confirm(0.2, "later") is not None
    assert plane.scheduler.yield_rank("task") > 0  # over its share beside a light tenant
    free = plane.scheduler.one_shot
    assert free("task") and not free("agent")
    assert not free("later")  # a later class's task yields as asked for
    plane.admission.peaks.back("task")  # it came back: a session that returns
    assert not free("task")


def test_a_call_that_starts_after_its_session_ended_leaves_nothing_in_the_scheduler() -> None:
    # Two requests of a session granted at once; one's end ends the session (final, DELETE)
    # before the other's task resumes and starts its call: the scheduler forgets it again.
    plane, _ = _plane()
    plane.tick(0.0, {"a": FRESH, "b": FRESH}, at=0.0, cpu=None)
    gen = plane.request(0.1, "s", "t", chars=400).incarnation
    p = plane.confirm(0.1, "s")
    assert p is not None
    plane.session_end(0.2, "s", EndReason.DELETED)
    t = plane.call_start(0.3, "s", p.worker, chars=400)
    end = plane.call_end(0.5, "s", t, incarnation=gen, ok=True, admitted=True,
                         prompt_tokens=100, completion_tokens=10, continues=False)
    assert end.result is not None and end.result.ticket is t
    assert "s" not in plane.scheduler._sessions and plane.scheduler.in_flight(p.worker) == 0


def test_a_waiting_request_whose_client_left_stops_counting_while_another_waits() -> None:
    plane, _ = _plane()  # nothing observed yet: every request waits
    for _ in range(2):
        ans = plane.request(0.1, "s", "t", chars=400)
        assert ans.kind is DecisionKind.WAIT
    plane.waiter_left("s")  # one client left, the other waits
    assert plane.phase("s") is Phase.WAITING
    out = plane.tick(0.3, {"a": FRESH, "b": FRESH}, at=0.3, cpu=None)
    assert out.proposed == ["s"] and plane.confirm(0.3, "s") is not None
    t = plane.call_start(0.3, "s", plane.held("s") or "", chars=400)
    plane.call_end(0.5, "s", t, incarnation=ans.incarnation, ok=True, admitted=True,
                   prompt_tokens=100, completion_tokens=10, continues=True)
    assert plane.phase("s") is Phase.DORMANT  # its one request is over: not in a call for ever


def _in_call(plane: ControlPlane, now: float, key: str) -> tuple[int | None, Ticket]:
    """A request of ``key`` admitted and confirmed, its call started: (its incarnation,
    its ticket)."""
    ans = plane.request(now, key, "t", chars=400)
    plane.confirm(now, key)
    assert ans.worker is not None
    t = plane.call_start(now, key, ans.worker, chars=400)
    assert t is not None
    return ans.incarnation, t


def test_a_call_that_outlives_its_session_ends_as_its_own_not_the_next_sessions_of_its_key(
) -> None:
    plane, _ = _plane()
    plane.tick(0.0, {"a": FRESH, "b": FRESH}, at=0.0, cpu=None)
    old, t_old = _in_call(plane, 0.1, "s")
    plane.session_end(0.2, "s", EndReason.DELETED)  # DELETE while its call runs
    new, t_new = _in_call(plane, 0.3, "s")  # the client reuses the id at once
    assert new != old
    # The old call ends (its driver may think the key's session goes on: it is a new one).
    plane.call_end(0.4, "s", t_old, incarnation=old, ok=True, admitted=True,
                   prompt_tokens=100, completion_tokens=10, chars=400, continues=True)
    assert plane.phase("s") is Phase.IN_CALL  # the new session's own call still runs
    rec = plane.admission.sessions.get("s")
    assert rec is not None and rec.in_flight == 1
    assert plane.scheduler.ledger.reservation("s") is None  # nothing retained for the old one
    plane.call_end(0.5, "s", t_new, incarnation=new, ok=True, admitted=True,
                   prompt_tokens=100, completion_tokens=10, chars=400, continues=True)
    assert plane.phase("s") is Phase.DORMANT and rec.in_flight == 0


def test_a_lost_lease_gives_back_the_sessions_kv_reservation() -> None:
    plane, _ = _plane()
    measured = dataclasses.replace(FRESH, prefill_tokens_per_s=1000.0)
    plane.tick(0.0, {"a": measured, "b": measured}, at=0.0, cpu=None)
    plane.sched_tick(0.0, {"a": measured, "b": measured})  # the workers' prefill speed
    gen, t = _in_call(plane, 0.1, "s")
    for now in (0.5, 3.0):  # two calls with a 2 s tool phase between: its tool time is known
        plane.call_end(now, "s", t, incarnation=gen, ok=True, admitted=True, prompt_tokens=4000,
                       completion_tokens=10, chars=8000, continues=True)
        plane.tracker.response_ended("s", now)
        plane.tracker.request_started("s", now + 2.0)
        plane.request(now + 2.0, "s", "t", chars=8000)
        t = plane.call_start(now + 2.0, "s", t.worker, chars=8000) or t
    plane.call_end(5.5, "s", t, incarnation=gen, ok=True, admitted=True, prompt_tokens=4000,
                   completion_tokens=10, chars=8000, continues=True)
    held = plane.scheduler.ledger.reservation("s")  # re-prefill 4 s > its 2 s tool: retained
    assert held is not None and plane.scheduler.retained_blocks(t.worker) > 0
    out = plane.lost(6.0, "s", t.worker)  # another replica took the session over
    assert out.returned == [held]
    assert plane.scheduler.ledger.reservation("s") is None
    assert plane.scheduler.retained_blocks(t.worker) == 0


def test_a_hold_that_ends_while_a_session_waits_lets_it_in_at_that_moment() -> None:
    # Two dormant sessions' forecasts (2 × 640 tokens × growth 2 = 160 of 180 usable blocks)
    # keep "late" out until their holds end, 4 × their usual tool time of 1 s after their calls:
    # the driver's timer at next_deadline lets it in then, not at the next tick.
    cfg = load_config(None, environ={}, overrides={"workers": ["http://w0:1"], "admission": {
        "tuning": {"peak_free_sessions": 0, "peak_overcommit_max": 1.0, "idle_admit": False,
                   "kv_hold_min_s": 2.0}}})
    plane = ControlPlane(cfg, ["w0"], tool_cpus=4.0)
    plane.admission.sessions.returns.record("t", True)  # its sessions come back: held
    obs = dataclasses.replace(FRESH, total_blocks=200)
    plane.tick(0.0, {"w0": obs}, at=0.0, cpu=None)
    for key in ("s0", "s1"):
        ans = plane.request(0.0, key, "t", tokens=640)
        assert plane.confirm(0.0, key) is not None
        plane.call_end(0.1, key, None, incarnation=ans.incarnation, ok=True, admitted=True,
                       prompt_tokens=640, usual_tool_s=1.0)
    assert plane.next_deadline() is None  # nobody waits: the holds end at the ticks
    assert plane.request(0.2, "late", "t", tokens=640).kind is DecisionKind.WAIT
    assert plane.next_deadline() == 4.1
    assert plane.expire(4.0).proposed == []  # not due yet
    out = plane.expire(4.1)
    assert out.proposed == ["late"] and plane.phase("late") is Phase.PENDING
    assert plane.next_deadline() is None


def _quiet_past_hold(report_tool: bool) -> float | None:
    """A session's one call, then silence past its KV hold (20 s): its time admitted paces the
    measured overlap's decay unless its client reported a tool still running."""
    plane, _ = _plane()
    plane.tick(0.0, {"a": FRESH, "b": FRESH}, at=0.0, cpu=None)
    ans = plane.request(0.1, "s", "t", chars=400)
    p = plane.confirm(0.1, "s")
    assert p is not None
    t = plane.call_start(0.1, "s", p.worker, chars=400, max_new_tokens=10)
    plane.call_end(1.0, "s", t, incarnation=ans.incarnation, ok=True, admitted=True,
                   prompt_tokens=100, completion_tokens=10, chars=400, continues=True)
    if report_tool:
        plane.tracker.explicit_event("s", "tool_start", "pytest", 1.0, None)
    for k in range(2, 40):  # past the hold, before the idle timeout (60 s)
        plane.tick(float(k), {"a": FRESH, "b": FRESH}, at=float(k), cpu=None)
    assert plane.phase("s") is Phase.DORMANT
    return plane.admission.overlaps.lifetime_s


def test_a_session_quiet_in_a_tool_its_client_reported_does_not_pace_the_decay() -> None:
    assert _quiet_past_hold(report_tool=False) is not None  # as a plain client's: likely done
    assert _quiet_past_hold(report_tool=True) is None  # its tool runs: the task goes on
