"""AdmissionCore: the sans-IO admission plane, events in, actions out."""

from __future__ import annotations

from typing import Any

from marsproxy.aimd.admission import AdmissionCore, DecisionKind, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig, AdmissionTuning
from marsproxy.core.events import Rejected, SessionAdmitted, SessionEnd, SessionQueued
from marsproxy.core.session_record import EndReason, SessionState


def sig(**kw: Any) -> WorkerSignals:
    base: dict[str, Any] = dict(kv_usage=0.3, free_blocks=10_000, total_blocks=10_000,
                                block_size=16)
    base.update(kw)
    return WorkerSignals(**base)


def core(workers: tuple[str, ...] = ("w0",), **cfg: Any) -> AdmissionCore:
    # The queue's mechanics need a count that binds: window_max (the operator's ceiling, which
    # binds with or without overload) at the window's size unless a test sets it.
    base: dict[str, Any] = dict(window_init=4, window_min=2)
    base.update(cfg)
    base.setdefault("window_max", base["window_init"])
    c = AdmissionCore(_config(base), workers)
    c.tick(0.0, {w: sig() for w in workers})
    return c


def test_fail_closed_before_any_signal() -> None:
    c = AdmissionCore(AdmissionConfig(), ["w0"])
    d = c.on_request(0.0, "s", "t", 100)
    assert d.kind is DecisionKind.WAIT
    assert isinstance(d.actions.events[0], SessionQueued)
    acts = c.tick(0.1, {"w0": sig()})
    assert [a.entry.session for a in acts.admitted] == ["s"]


def test_burst_admitted_up_to_window_rest_wait_then_follow() -> None:
    c = core()
    decisions = [c.on_request(1.0, f"s{i}", "t", 100) for i in range(6)]
    assert [d.kind for d in decisions] == [DecisionKind.ADMITTED] * 4 + [DecisionKind.WAIT] * 2
    assert {d.worker for d in decisions[:4]} == {"w0"}
    assert c.sessions.admitted_on("w0") == 4 and len(c.queue) == 2
    # s0 ends (delete): s4 gets its slot in the same step.
    acts = c.on_session_end(2.0, "s0", EndReason.DELETED)
    assert [a.entry.session for a in acts.admitted] == ["s4"]
    assert acts.ended == [("s0", EndReason.DELETED)]
    assert any(isinstance(e, SessionEnd) for e in acts.events)
    assert any(isinstance(e, SessionAdmitted) and e.wait_s == 1.0 for e in acts.events)
    assert c.sessions.admitted_on("w0") == 4


def test_continuations_are_never_held() -> None:
    c = core()
    for i in range(4):
        c.on_request(1.0, f"s{i}", "t", 100)
    c.on_response_end(2.0, "s0")
    # KV overload collapses the window and cap below what is admitted.
    c.tick(3.0, {"w0": sig(kv_usage=0.99)})
    assert c.controllers["w0"].effective_limit == 2
    d = c.on_request(4.0, "s0", "t", 100)
    assert d.kind is DecisionKind.ADMITTED and d.worker == "w0" and d.reason == "continuation"
    # A new session waits until admitted < effective limit.
    assert c.on_request(4.0, "new", "t", 100).kind is DecisionKind.WAIT
    c.on_session_end(5.0, "s1", EndReason.DELETED)
    c.on_session_end(5.0, "s2", EndReason.DELETED)
    assert "new" in c.queue  # 2 admitted, limit 2
    acts = c.on_session_end(5.0, "s3", EndReason.DELETED)
    assert [a.entry.session for a in acts.admitted] == ["new"]


def test_final_request_ends_session_after_its_response() -> None:
    c = core(window_init=2, window_min=1)
    c.on_request(1.0, "a", "t", 10)
    c.on_request(1.0, "b", "t", 10)
    assert c.on_request(1.0, "c", "t", 10).kind is DecisionKind.WAIT
    c.on_response_end(2.0, "a")
    c.on_request(3.0, "a", "t", 10, final=True)
    acts = c.on_response_end(4.0, "a")
    assert acts.ended == [("a", EndReason.FINAL)]
    assert [x.entry.session for x in acts.admitted] == ["c"]
    assert c.sessions.get("a") is None


def test_idle_timeout_frees_the_slot() -> None:
    c = core(window_init=1, window_min=1, window_max=1, idle_timeout_min_s=10.0,
             idle_timeout_factor=2.0)
    c.on_request(1.0, "a", "t", 10)
    c.on_response_end(2.0, "a", usual_tool_s=3.0)  # timeout max(10, 6) = 10 s
    c.on_request(3.0, "b", "t", 10)
    assert c.tick(11.9, {"w0": sig()}).ended == []
    acts = c.tick(12.0, {"w0": sig()})
    assert acts.ended == [("a", EndReason.IDLE_TIMEOUT)]
    assert [x.entry.session for x in acts.admitted] == ["b"]


def test_queue_deadline_gives_503_with_retry_after() -> None:
    c = core(window_init=1, window_min=1, queue_deadline_s=10.0, aging_margin_s=2.0)
    c.on_request(0.0, "a", "t", 10)
    c.on_request(1.0, "b", "t", 10)
    acts = c.tick(11.0, {"w0": sig()})
    (exp,) = acts.expired
    assert (exp.session, exp.status, exp.reason) == ("b", 503, "queue_deadline")
    assert 1 <= exp.retry_after_s <= 60
    assert any(isinstance(e, Rejected) and e.status == 503 for e in acts.events)
    assert c.sessions.get("b") is None and "b" not in c.queue


def test_expiry_without_healthy_worker_says_so() -> None:
    c = core(queue_deadline_s=10.0, aging_margin_s=2.0)
    c.tick(0.5, {"w0": sig(healthy=False)})
    c.on_request(1.0, "a", "t", 10)
    (exp,) = c.tick(11.0, {"w0": sig(healthy=False)}).expired
    assert exp.reason == "no_healthy_worker"


def test_queue_full_gives_429() -> None:
    c = core(window_init=1, window_min=1, queue_max=1)
    c.on_request(0.0, "a", "t", 10)
    assert c.on_request(0.0, "b", "t", 10).kind is DecisionKind.WAIT
    d = c.on_request(0.0, "c", "t", 10)
    assert d.kind is DecisionKind.REJECT and d.status == 429 and d.reason == "queue_full"
    assert d.retry_after_s == 60  # nothing admitted through the queue yet: the cap
    assert isinstance(d.actions.events[0], Rejected)
    assert c.sessions.get("c") is None


def test_second_request_of_a_waiting_session_waits_too() -> None:
    c = core(window_init=1, window_min=1)
    c.on_request(0.0, "a", "t", 10)
    c.on_request(0.0, "b", "t", 10)
    assert c.on_request(0.5, "b", "t", 10).kind is DecisionKind.WAIT
    assert len(c.queue) == 1
    acts = c.on_session_end(1.0, "a", EndReason.DELETED)
    assert [x.entry.session for x in acts.admitted] == ["b"]
    rec = c.sessions.get("b")
    assert rec is not None and rec.in_flight == 2


def test_abandoned_waiting_session_leaves_the_queue() -> None:
    c = core(window_init=1, window_min=1)
    c.on_request(0.0, "a", "t", 10)
    c.on_request(0.0, "b", "t", 10)
    acts = c.on_session_end(1.0, "b", EndReason.ABANDONED)
    assert acts.ended == [("b", EndReason.ABANDONED)] and acts.admitted == []
    assert "b" not in c.queue and c.sessions.get("b") is None


def test_kv_fit_uses_budget_and_pending_promises() -> None:
    # 1000 blocks total, 400 free: budget 400 − 100 reserve − 50 retained = 250 blocks.
    c = core(window_init=8, kv_fit_peak=False)
    c.tick(0.2, {"w0": sig(free_blocks=400, total_blocks=1000, retained_blocks=50)})
    assert c.budget("w0") == 250
    assert c.on_request(1.0, "a", "t", 160 * 16).kind is DecisionKind.ADMITTED  # 160 blocks
    assert c.budget("w0") == 90  # promised until the worker has served its prompt
    assert c.on_request(1.0, "b", "t", 100 * 16).kind is DecisionKind.WAIT
    acts = c.on_response_end(2.0, "a")  # served: its promise is settled, b fits now
    assert [x.entry.session for x in acts.admitted] == ["b"]
    assert c.budget("w0") == 250 - 100  # b's promise


def test_stale_worker_gets_no_new_sessions() -> None:
    c = core(("w0", "w1"))
    c.tick(0.2, {"w0": sig(), "w1": sig(stale=True)})
    d = [c.on_request(1.0, f"s{i}", "t", 10) for i in range(3)]
    assert {x.worker for x in d} == {"w0"}
    c.tick(0.4, {"w0": sig()})  # w1 not reported at all: stale too
    assert c.controllers["w1"].stale and c.budget("w1") == 0


def test_estimator_corrected_through_response_end() -> None:
    c = core()
    c.on_request(1.0, "a", "t", c.estimator.estimate("a", 4000))
    c.on_response_end(2.0, "a", prompt_chars=4000, prompt_tokens=2000)
    assert c.estimator.estimate("a", 8000) == 4000


def test_disabled_admits_everything() -> None:
    c = core(enabled=False, window_init=2, window_min=1)
    d = [c.on_request(1.0, f"s{i}", "t", 10) for i in range(5)]
    assert all(x.kind is DecisionKind.ADMITTED for x in d)
    assert c.sessions.admitted_on("w0") == 5 and len(c.queue) == 0


def test_disabled_places_on_healthy_workers_whose_metrics_are_not_read_yet() -> None:
    # Admission off: health is the only gate. A worker the probes have not read yet (it just
    # started) takes its share of a burst at once; an unhealthy one takes none.
    c = core(("w0", "w1", "w2"), enabled=False)
    c.tick(0.2, {"w0": sig(), "w1": sig(stale=True), "w2": sig(healthy=False)})
    placed = [c.on_request(1.0, f"s{i}", "t", 10).worker for i in range(6)]
    assert placed == ["w0", "w1"] * 3


def test_window_change_events_from_tick() -> None:
    c = core()
    acts = c.tick(0.2, {"w0": sig(kv_usage=0.95)})
    assert [(e.old, e.new, e.reason) for e in acts.window_changes] == [(4, 3, "kv_overload")]
    assert acts.window_changes[0] in acts.events


def test_adopting_a_session_admitted_elsewhere_is_not_a_new_admission() -> None:
    c = core(window_init=2, window_min=2, window_max=2)
    for i in range(2):
        assert c.on_request(1.0, f"s{i}", "t", 100).kind is DecisionKind.ADMITTED
    assert c.on_request(1.0, "waiting", "t", 100).kind is DecisionKind.WAIT
    # The window is full, yet a session with a live lease elsewhere is served at once.
    d = c.on_adopt(2.0, "moved", "t", "w0", 100, turns=5, correction=0.5)
    assert d.kind is DecisionKind.ADMITTED and d.worker == "w0" and d.reason == "adopted"
    assert not d.actions.events  # no session_queued / session_admitted: it was admitted before
    rec = c.sessions.get("moved")
    assert rec is not None and rec.state is SessionState.ADMITTED and rec.turns == 6
    assert c.sessions.admitted_on("w0") == 3 and "moved" not in c.queue
    assert c.estimator.correction("moved") == 0.5
    # Its next request is a plain continuation; its end frees a slot like any other.
    c.on_response_end(3.0, "moved")
    assert c.on_adopt(4.0, "moved", "t", "w0", 100).reason == "continuation"
    c.on_response_end(5.0, "moved")
    acts = c.on_session_end(6.0, "moved", EndReason.MOVED)
    assert acts.ended == [("moved", EndReason.MOVED)]
    assert c.sessions.admitted_on("w0") == 2 and not acts.admitted  # still 2 ≥ the limit


def test_relocate_moves_an_unserved_session_to_a_worker_where_it_fits() -> None:
    c = core(("w0", "w1", "w2"), window_init=4, window_min=2, window_max=8)
    c.tick(1.0, {"w0": sig(), "w1": sig(free_blocks=5, total_blocks=10_000), "w2": sig()})
    d = c.on_request(1.0, "s", "t", 1600)  # 100 blocks
    assert d.kind is DecisionKind.ADMITTED
    first = d.worker
    assert first is not None
    before = c.budget(first)
    assert c.relocate(2.0, "s", ["w1"]) is None  # w1 has no KV room for it
    target = "w2" if first == "w0" else "w0"
    assert c.relocate(2.0, "s", [target]) == target
    rec = c.sessions.get("s")
    assert rec is not None and rec.worker == target
    assert c.sessions.admitted_on(first) == 0 and c.sessions.admitted_on(target) == 1
    assert c.budget(first) == (before or 0) + 100  # the KV promise moved with it
    c.on_response_end(3.0, "s")  # served on its new worker: from now on it stays there
    assert c.relocate(4.0, "s", [first]) is None


def _config(flat: dict[str, Any]) -> AdmissionConfig:
    """``flat`` keys of both levels: the tuning ones go under ``tuning``."""
    tuned = {k: v for k, v in flat.items() if k in AdmissionTuning.model_fields}
    rest = {k: v for k, v in flat.items() if k not in tuned}
    return AdmissionConfig(**rest, tuning=AdmissionTuning(**tuned))
