"""A new session while nothing waits (``AdmissionQueue.admit_alone``): the same decision, and the
same state after it, as queueing it and running a pass, without building its lanes."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from marsproxy.aimd.admission import Actions, AdmissionCore, Decision, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig, AdmissionTuning
from marsproxy.aimd.queue import AdmissionQueue, WorkerView
from marsproxy.core.session_record import EndReason

CFG = AdmissionConfig(tuning=AdmissionTuning(long_prompt_tokens=1000))


def view(**kw: Any) -> WorkerView:
    base: dict[str, Any] = dict(name="w0", admitted=0, limit=4, budget_blocks=10_000,
                                free_blocks=20_000)
    base.update(kw)
    return WorkerView(**base)


def queue_state(q: AdmissionQueue, now: float) -> tuple[Any, ...]:
    s = q.shares
    return (len(q), q.positions(now), q.mode, q.admission_rate(now), s.virtual_time,
            {t: s.tag(t) for t in ("t", "u")}, q.retry_after(now))


def test_nothing_waits_and_a_worker_has_room_it_is_admitted_as_a_pass_would() -> None:
    fast, slow = AdmissionQueue(CFG), AdmissionQueue(CFG)
    workers = [view(name="w0", admitted=2), view(name="w1", admitted=1)]
    a = fast.admit_alone(fast.entry("s", "t", 1.0, 400), 1.0, workers)
    assert slow.push(slow.entry("s", "t", 1.0, 400))
    [b] = slow.select(1.0, workers)
    assert a is not None and (a.worker, a.forced) == (b.worker, b.forced) == ("w1", False)
    assert a.entry == b.entry  # numbered, its length class set, as push sets them
    assert queue_state(fast, 2.0) == queue_state(slow, 2.0)
    assert fast.admission_rate(2.0) is not None and fast.shares.tag("t") > 0  # counted


def test_a_session_that_would_wait_changes_nothing() -> None:
    q = AdmissionQueue(CFG)
    before = queue_state(q, 1.0)
    full = [view(admitted=4, limit=4)]
    assert q.admit_alone(q.entry("s", "t", 1.0, 400), 1.0, full) is None
    small = [view(admitted=1, budget_blocks=10)]  # 400 tokens need 25 blocks: no fit
    assert q.admit_alone(q.entry("s", "t", 1.0, 400), 1.0, small) is None
    assert queue_state(q, 1.0) == before


def test_nothing_admitted_anywhere_takes_the_oldest_anyway() -> None:
    # The no-deadlock rule: too large for every worker, yet nothing runs anywhere.
    q, slow = AdmissionQueue(CFG), AdmissionQueue(CFG)
    tight = [view(budget_blocks=10, free_blocks=10)]
    a = q.admit_alone(q.entry("s", "t", 1.0, 4000), 1.0, tight)
    assert slow.push(slow.entry("s", "t", 1.0, 4000))
    [b] = slow.select(1.0, tight)
    assert a is not None and a.forced and b.forced and a.worker == b.worker == "w0"
    assert queue_state(q, 1.0) == queue_state(slow, 1.0)


# -- the core, with and without it, over random event sequences -------------------------------

WORKERS = ("w0", "w1")
CORE_CFG = AdmissionConfig(
    window_init=3, window_min=1, window_max=5, queue_max=6, queue_deadline_s=20.0,
    idle_timeout_min_s=5.0, idle_timeout_max_s=30.0,
    tuning=AdmissionTuning(aging_margin_s=5.0, long_prompt_tokens=1500, max_long_in_flight=1),
)
signals_st = st.builds(
    WorkerSignals, healthy=st.booleans(), stale=st.booleans(),
    kv_usage=st.one_of(st.none(), st.floats(0.0, 1.0)), free_blocks=st.integers(0, 400),
    total_blocks=st.just(400), block_size=st.just(16), retained_blocks=st.integers(0, 50),
    running=st.one_of(st.none(), st.integers(0, 3)),
)
op_st = st.one_of(
    st.tuples(st.just("req"), st.integers(0, 9), st.sampled_from(["t", "u"]),
              st.integers(1, 3000), st.booleans(), st.sampled_from([None, "batch"])),
    st.tuples(st.just("resp"), st.integers(0, 9), st.integers(1, 4000)),
    st.tuples(st.just("end"), st.integers(0, 9),
              st.sampled_from([EndReason.DELETED, EndReason.ABANDONED, EndReason.FINAL])),
    st.tuples(st.just("tick"), st.fixed_dictionaries({w: signals_st for w in WORKERS})),
)


def _answer(x: Decision | Actions) -> tuple[Any, ...]:
    d = x if isinstance(x, Decision) else None
    a = x.actions if isinstance(x, Decision) else x
    head = () if d is None else (d.kind, d.worker, d.reason, d.idle, d.retry_after_s)
    return (*head, [(b.entry.session, b.worker, b.idle, b.forced) for b in a.admitted],
            a.expired, a.ended, a.events)


def _state(c: AdmissionCore, now: float) -> tuple[Any, ...]:
    sessions = sorted((r.key, r.state, r.worker, r.in_flight, r.queued_at, r.admitted_at)
                      for r in c.sessions)
    return (*queue_state(c.queue, now), sessions, c.views(now))


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 3.0), op_st), max_size=70))
def test_the_core_decides_the_same_with_and_without_it(ops: list[tuple[float, Any]]) -> None:
    fast, slow = AdmissionCore(CORE_CFG, WORKERS), AdmissionCore(CORE_CFG, WORKERS)
    slow.queue.admit_alone = lambda *_a, **_k: None  # type: ignore[method-assign]
    t = 0.0
    for dt, op in ops:
        t += dt
        for c in (fast, slow):
            if op[0] == "req":
                got: Any = c.on_request(t, f"s{op[1]}", op[2], op[3], final=op[4], cls=op[5])
            elif op[0] == "resp":
                rec = c.sessions.get(f"s{op[1]}")
                if rec is None or rec.in_flight == 0:
                    got = None
                else:
                    got = c.on_response_end(t, f"s{op[1]}", prompt_tokens=op[2],
                                            cached_tokens=op[2] // 2, completion_tokens=20)
            elif op[0] == "end":
                got = c.on_session_end(t, f"s{op[1]}", op[2])
            else:
                got = c.tick(t, op[1])
            if c is fast:
                want = None if got is None else _answer(got)
            else:
                assert (None if got is None else _answer(got)) == want, op
        assert _state(fast, t) == _state(slow, t), op


def test_a_light_tenant_beside_a_heavy_one_is_placed_as_a_pass_would() -> None:
    # Tenant u holds w0's KV forecast. t's first session, once waiting, is a light tenant's
    # that yields to nobody: it fits on w0 beside u's sessions, which yield to it (``Yields``),
    # and w0 holds fewer sessions than w1. Not counted as waiting, only w1 would fit.
    placed = []
    for alone in (True, False):
        c = AdmissionCore(AdmissionConfig(), ["w0", "w1"])
        if not alone:
            c.queue.admit_alone = lambda *_a, **_k: None  # type: ignore[method-assign]
        sig = WorkerSignals(kv_usage=0.0, free_blocks=1000, total_blocks=1000, block_size=16)
        c.tick(0.0, {"w0": sig, "w1": sig})
        for i, (w, tokens) in enumerate([("w0", 5000), ("w0", 5000), ("w1", 100), ("w1", 100),
                                         ("w1", 100)]):
            c.on_adopt(0.1, f"u{i}", "u", w, tokens)
        placed.append(c.on_request(0.2, "t0", "t", 1000).worker)
    assert placed == ["w0", "w0"]
