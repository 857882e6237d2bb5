"""AdmissionQueue: ordering modes, long sessions, no-deadlock, placement, 429, Retry-After."""

from __future__ import annotations

from typing import Any

import pytest

from marsproxy.aimd.config import AdmissionConfig, AdmissionTuning
from marsproxy.aimd.queue import AdmissionQueue, OrderMode, QueueEntry, WorkerView
from marsproxy.aimd.rate import AdmissionRate, retry_after_s

# Long = more than 1000 tokens; 16-token blocks.
CFG = AdmissionConfig(tuning=AdmissionTuning(long_prompt_tokens=1000))


def worker(name: str = "w0", **kw: Any) -> WorkerView:
    base: dict[str, Any] = dict(admitted=0, limit=10, budget_blocks=10_000, free_blocks=20_000)
    base.update(kw)
    return WorkerView(name=name, **base)


def fill(q: AdmissionQueue, sizes: list[int], t0: float = 0.0) -> None:
    for i, tokens in enumerate(sizes):
        assert q.push(q.entry(f"s{i}", "t", t0 + i, tokens))


def picked(q: AdmissionQueue, now: float, workers: list[WorkerView]) -> list[str]:
    return [a.entry.session for a in q.select(now, workers)]


def test_light_load_is_arrival_order() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [800, 100, 500])
    assert q.choose_mode([worker(limit=3)]) is OrderMode.ARRIVAL
    assert [e.session for e in q.ordered(10.0, OrderMode.ARRIVAL)] == ["s0", "s1", "s2"]
    assert picked(q, 10.0, [worker(limit=3)]) == ["s0", "s1", "s2"]


def test_backlog_over_slots_is_shortest_first() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [800, 100, 500])
    w = worker(limit=2)  # 3 waiting, 2 slots: the backlog does not fit
    assert q.choose_mode([w]) is OrderMode.SHORTEST_FIRST
    assert picked(q, 10.0, [w]) == ["s1", "s2"]


def test_backlog_over_kv_is_shortest_first() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [800, 100, 500])  # 1400 tokens > 80 blocks · 16 = 1280
    w = worker(budget_blocks=80)
    assert q.choose_mode([w]) is OrderMode.SHORTEST_FIRST
    # 100 (7 blocks) then 500 (32 blocks) fit 80; 800 (50 blocks) no longer does.
    assert picked(q, 10.0, [w]) == ["s1", "s2"]
    assert "s0" in q


def test_kv_overload_is_shortest_first() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [800, 100])
    assert q.choose_mode([worker(kv_overloaded=True)]) is OrderMode.SHORTEST_FIRST


def test_cpu_overload_is_arrival_order_by_default() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [100, 800, 500, 800])
    w = worker(limit=2, cpu_overloaded=True, kv_overloaded=True)
    assert q.choose_mode([w]) is OrderMode.ARRIVAL  # not shortest first, though KV is full too
    assert picked(q, 10.0, [w]) == ["s0", "s1"]
    assert [s for s, _ in q.positions(10.0)] == ["s2", "s3"]


def test_cpu_overload_keeps_arrival_order() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [100, 800, 500, 800])
    w = worker(limit=2, cpu_overloaded=True)
    assert q.choose_mode([w]) is OrderMode.ARRIVAL
    assert picked(q, 10.0, [w]) == ["s0", "s1"]
    assert [s for s, _ in q.positions(10.0)] == ["s2", "s3"]


def test_unplaceable_workers_do_not_count() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [100])
    assert picked(q, 1.0, [worker(healthy=False), worker("w1", stale=True)]) == []
    assert len(q) == 1


def test_long_sessions_capped_while_short_ones_wait() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [2000, 2000, 2000, 100])  # three long, one short
    admitted = picked(q, 10.0, [worker()])
    assert sorted(admitted) == ["s0", "s1", "s3"]  # two long + the short
    assert q.get("s2") is not None and q.get("s2").long  # type: ignore[union-attr]


def test_long_cap_counts_already_admitted_long_sessions() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [2000, 100])
    assert picked(q, 10.0, [worker(admitted=2, long_admitted=2)]) == ["s1"]
    assert "s0" in q


def test_long_cap_is_per_worker() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [2000, 2000, 2000, 100])
    ws = [worker("a", long_admitted=2, admitted=2), worker("b", budget_blocks=5000)]
    got = {a.entry.session: a.worker for a in q.select(10.0, ws)}
    assert got == {"s0": "b", "s1": "b", "s3": "a"}


def test_only_long_ones_are_packed_into_free_kv() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [1600] * 5)  # 100 blocks each, all long
    # Pack room: ⌊0.9 · 350⌋ − 0 = 315 blocks → 3 sessions, beyond the cap of 2.
    w = worker(long_admitted=0, budget_blocks=10_000, free_blocks=350)
    assert picked(q, 10.0, [w]) == ["s0", "s1", "s2"]
    # Retained blocks come off the pack room too: ⌊0.9·350⌋ − 120 = 195 → one more.
    assert picked(q, 11.0, [worker(admitted=3, free_blocks=350, retained_blocks=120)]) == ["s3"]


def test_no_deadlock_admits_oldest_when_nothing_runs() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [900, 700])  # 57 and 44 blocks; the budget is 10
    w = worker(budget_blocks=10)
    (a,) = q.select(10.0, [w])
    assert a.entry.session == "s0" and a.forced and a.worker == "w0"
    # Something runs now: nothing is forced any more.
    assert picked(q, 11.0, [worker(budget_blocks=10, admitted=1)]) == []


def test_an_empty_worker_takes_the_oldest_that_fits_no_budget() -> None:
    # A prompt above the KV reserve fits no budget, but a worker holding nothing takes it, as
    # the engine without a proxy would: the other worker's session does not stop that.
    q = AdmissionQueue(CFG)
    fill(q, [900, 700])
    (a,) = q.select(10.0, [worker("w0", budget_blocks=10, admitted=1),
                           worker("w1", budget_blocks=10)])
    assert a.entry.session == "s0" and a.forced and a.worker == "w1"
    assert picked(q, 11.0, [worker("w0", budget_blocks=10, admitted=1),
                            worker("w1", budget_blocks=10, admitted=1)]) == []


def test_no_deadlock_needs_a_placeable_worker_with_a_slot() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [900])
    assert picked(q, 1.0, [worker(budget_blocks=0, stale=True)]) == []
    assert picked(q, 1.0, [worker(budget_blocks=0, limit=0)]) == []


def test_placement_by_fewest_sessions_ties_in_worker_order() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [320, 320, 320, 320, 320])  # 20 blocks each
    ws = [worker("a", budget_blocks=100, admitted=1), worker("b", budget_blocks=130, admitted=1),
          worker("c", budget_blocks=500, admitted=10),  # c: no free slot
          worker("d", budget_blocks=30),  # d: fewest sessions, room for one
          worker("e", budget_blocks=500, admitted=0)]  # e: its 3 dormant, released: no slot
    got = [(a.entry.session, a.worker) for a in q.select(10.0, ws)]
    # d, e at 0: d, then e; a, b, e at 1 (d is full): a, then b, then e.
    assert got == [("s0", "d"), ("s1", "e"), ("s2", "a"), ("s3", "b"), ("s4", "e")]


def test_slots_never_exceeded() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [10] * 20)
    ws = [worker("a", limit=5, admitted=3), worker("b", limit=4, admitted=4)]
    got = q.select(10.0, ws)
    assert len(got) == 2 and {a.worker for a in got} == {"a"}
    assert len(q) == 18


def test_push_full_and_duplicate() -> None:
    q = AdmissionQueue(AdmissionConfig(queue_max=2))
    assert q.push(q.entry("a", "t", 0.0, 1)) and q.push(q.entry("b", "t", 0.0, 1))
    assert not q.push(q.entry("c", "t", 0.0, 1))
    assert len(q) == 2 and "c" not in q
    with pytest.raises(ValueError):
        q.push(q.entry("a", "t", 0.0, 1))


def test_expire_and_remove() -> None:
    q = AdmissionQueue(AdmissionConfig(queue_deadline_s=10.0,
        tuning=AdmissionTuning(aging_margin_s=2.0)))
    fill(q, [1, 1, 1])  # arrivals 0, 1, 2 → deadlines 10, 11, 12
    assert q.expire(9.99) == []
    assert [e.session for e in q.expire(11.0)] == ["s0", "s1"]
    assert q.remove("s2") is not None and q.remove("s2") is None
    assert len(q) == 0


def test_urgent_session_goes_first() -> None:
    cfg = AdmissionConfig(queue_deadline_s=100.0,
        tuning=AdmissionTuning(long_prompt_tokens=1000, aging_margin_s=10.0))
    q = AdmissionQueue(cfg)
    fill(q, [900, 100, 200])  # s0 arrives at 0: deadline 100
    w = worker(limit=1, cpu_overloaded=False, kv_overloaded=True)  # shortest first
    assert picked(q, 50.0, [w]) == ["s1"]
    assert picked(q, 91.0, [w]) == ["s0"]  # within 10 s of its deadline: first


def test_urgent_session_that_does_not_fit_holds_the_pass() -> None:
    cfg = AdmissionConfig(queue_deadline_s=100.0,
        tuning=AdmissionTuning(long_prompt_tokens=10_000, aging_margin_s=10.0))
    q = AdmissionQueue(cfg)
    q.push(q.entry("big", "t", 0.0, 900))  # 57 blocks, deadline 100
    q.push(q.entry("small1", "t", 1.0, 100))  # 7 blocks
    w = worker(budget_blocks=40, admitted=1, kv_overloaded=True)
    assert picked(q, 20.0, [w]) == ["small1"]  # big is not urgent yet: the small one goes by
    q.push(q.entry("small2", "t", 40.0, 100))
    # big is urgent at 95 and does not fit: the capacity is held for it.
    assert picked(q, 95.0, [w]) == []
    assert picked(q, 95.2, [worker(budget_blocks=100, admitted=1)]) == ["big", "small2"]


def test_bypass_bound_promotes_a_session() -> None:
    cfg = AdmissionConfig(tuning=AdmissionTuning(long_prompt_tokens=10_000, max_bypass=3))
    q = AdmissionQueue(cfg)
    assert q.push(q.entry("big", "t", 0.0, 900))
    w = worker(limit=1, kv_overloaded=True)
    for i in range(3):
        q.push(q.entry(f"small{i}", "t", 1.0 + i, 10))
        assert picked(q, 2.0 + i, [w]) == [f"small{i}"]
    assert q.bypasses("big") == 3
    q.push(q.entry("small9", "t", 9.0, 10))
    assert picked(q, 10.0, [w]) == ["big"]


def test_entries_are_marked_long_by_the_queue() -> None:
    q = AdmissionQueue(CFG)
    e = QueueEntry("x", "t", 0.0, 1001, 300.0)
    q.push(e)
    assert e.long and e.seq == 1


def test_rate_and_retry_after() -> None:
    cfg = AdmissionConfig(tuning=AdmissionTuning(rate_halflife_s=30.0))
    q = AdmissionQueue(cfg)
    assert q.retry_after(0.0) == 60  # nothing observed: the cap
    w = worker(limit=10_000, budget_blocks=None)
    t = 0.0
    n = 0
    for _ in range(300):  # 2 admissions per second for 300 s
        for _ in range(2):
            q.push(q.entry(f"x{n}", "t", t, 10))
            n += 1
        q.select(t, [w])
        t += 1.0
    rate = q.admission_rate(t)
    assert rate is not None and 1.9 < rate < 2.1
    assert q.retry_after(t, ahead=19) == 10  # ⌈19 / ~2⌉
    assert q.retry_after(t, ahead=1) == 1
    assert q.retry_after(t, ahead=10_000) == 60
    # Admissions stop: the estimate decays and the advice grows.
    for _ in range(60):
        q.select(t, [worker(limit=0)])
        t += 1.0
    assert q.retry_after(t, ahead=20) > 10


def test_admission_rate_decays() -> None:
    r = AdmissionRate(10.0)
    assert r.per_second(0.0) is None
    r.record(0.0, 0)
    r.record(10.0, 100)
    first = r.per_second(10.0)
    assert first is not None and first > 0
    later = r.per_second(40.0)
    assert later is not None and later < first / 4


@pytest.mark.parametrize(
    ("ahead", "rate", "expected"),
    [(10, 2.0, 5), (10, 3.0, 4), (0, 2.0, 1), (5, None, 60), (5, 0.0, 60), (1000, 1.0, 60)],
)
def test_retry_after_s(ahead: int, rate: float | None, expected: int) -> None:
    assert retry_after_s(ahead, rate, 1, 60) == expected


def test_cpu_overload_skips_capped_long_sessions() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [3000, 100, 2500, 600])
    w = worker(cpu_overloaded=True, admitted=2, long_admitted=2)
    assert picked(q, 10.0, [w]) == ["s1", "s3"]  # shorts in arrival order; longs at their cap
    assert len(q) == 2


def test_shortest_first_stops_at_first_misfit() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [160, 320, 48, 800])  # 10, 20, 3, 50 blocks
    w = worker(budget_blocks=30, admitted=1, kv_overloaded=True)
    assert picked(q, 10.0, [w]) == ["s2", "s0"]  # 3 + 10 = 13; 20 more would be 33 > 30
    assert [s for s, _ in q.positions(10.0)] == ["s1", "s3"]


def test_misfits_are_skipped_outside_shortest_first() -> None:
    # Arrival order, and the backlog fits in total (120 blocks) but not piece by piece.
    q = AdmissionQueue(CFG)
    fill(q, [880, 880, 128, 32])  # 55, 55, 8, 2 blocks
    ws = [worker("a", budget_blocks=60), worker("b", budget_blocks=60)]
    assert q.choose_mode(ws) is OrderMode.ARRIVAL
    assert picked(q, 10.0, ws) == ["s0", "s1", "s3"]  # s2 no longer fits anywhere
    # Only long ones wait: the larger misses the pack room, the smaller fits it.
    q = AdmissionQueue(CFG)
    fill(q, [2000, 1600])  # 125 and 100 blocks; pack room ⌊0.9 · 120⌋ = 108
    w = worker(budget_blocks=200, free_blocks=120, cpu_overloaded=True)
    assert picked(q, 10.0, [w]) == ["s1"]


def test_cpu_overload_takes_long_sessions_under_the_cap() -> None:
    q = AdmissionQueue(CFG)
    fill(q, [2000, 100, 3000])
    w = worker(limit=2, cpu_overloaded=True, long_admitted=1, admitted=0)
    assert picked(q, 10.0, [w]) == ["s0", "s1"]  # one long fits under the cap of 2


def test_urgent_long_session_at_its_cap_does_not_block_short_ones() -> None:
    cfg = AdmissionConfig(queue_deadline_s=100.0,
        tuning=AdmissionTuning(long_prompt_tokens=1000, aging_margin_s=10.0))
    q = AdmissionQueue(cfg)
    q.push(q.entry("long", "t", 0.0, 2000))
    q.push(q.entry("short", "t", 50.0, 100))
    w = worker(admitted=2, long_admitted=2, kv_overloaded=True)
    assert picked(q, 95.0, [w]) == ["short"]  # the cap, not capacity, holds the long one


def test_stalled_queue_goes_by_deadline_but_backfills(monkeypatch: pytest.MonkeyPatch) -> None:
    q = AdmissionQueue(CFG)
    fill(q, [800, 100, 600, 200])  # 50, 7, 38, 13 blocks
    # Nothing admitted for a long time: every session is critical, so deadline order rules,
    # but one that does not fit and is not yet near its deadline lets the others backfill.
    monkeypatch.setattr(q._rate, "per_second", lambda now: 0.0)
    w = worker(budget_blocks=25, admitted=1, kv_overloaded=True)
    assert [e.session for e in q.ordered(10.0, OrderMode.SHORTEST_FIRST)] == [
        "s0", "s1", "s2", "s3"]
    assert picked(q, 10.0, [w]) == ["s1", "s3"]


def test_critical_prefix_follows_the_admission_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = AdmissionConfig(queue_deadline_s=100.0,
        tuning=AdmissionTuning(long_prompt_tokens=10_000, aging_margin_s=10.0))
    q = AdmissionQueue(cfg)
    fill(q, [900, 100, 200])  # deadlines 100, 101, 102
    q.push(q.entry("s3", "t", 40.0, 50))  # deadline 140
    monkeypatch.setattr(q._rate, "per_second", lambda now: 0.1)  # one admission per 10 s

    def order(now: float) -> list[str]:
        return [e.session for e in q.ordered(now, OrderMode.SHORTEST_FIRST)]

    # The j-th by deadline is critical once deadline − now − 10 ≤ 10·(j + 1): s2 (j = 2) at
    # t = 62, which makes s0..s2 the critical prefix; s3 (j = 3) only at t = 90.
    assert order(61.0) == ["s3", "s1", "s2", "s0"]
    assert order(62.0) == ["s0", "s1", "s2", "s3"]
    assert order(89.0) == ["s0", "s1", "s2", "s3"]



def test_sessions_that_will_not_grow_are_not_fitted() -> None:
    # The budget leaves 20 blocks of first prompt: a session that grows is fitted against it,
    # one that will not (its tenant's sessions do not return) is not: it holds no KV past its
    # call, so it waits in the engine's queue for blocks, not in this one. Slots still count.
    q = AdmissionQueue(CFG)
    for i, grows in enumerate([True, False, False, True]):
        assert q.push(q.entry(f"s{i}", "t", float(i), 16 * 15, grows=grows))  # 15 blocks
    # s0 (grows) takes 15 of 20; s1 and s2 go without the fit, s3 no longer fits (5 left).
    assert picked(q, 10.0, [worker(budget_blocks=20)]) == ["s0", "s1", "s2"]
    q2 = AdmissionQueue(CFG)
    assert q2.push(q2.entry("a", "t", 0.0, 16 * 30, grows=False))
    assert q2.push(q2.entry("b", "t", 0.0, 16 * 30, grows=False))
    full = {"admitted": 1, "limit": 2, "budget_blocks": -50}  # one slot left, no KV room
    assert picked(q2, 1.0, [worker(**full)]) == ["a"]
