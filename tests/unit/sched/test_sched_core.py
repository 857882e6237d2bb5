"""The scheduler core: levels per policy, gated dispatch (cap, KV fit, backfill bound, aging),
retention into the ledger, release on return, expiry and drops under pressure, resume stats."""

from __future__ import annotations

from typing import Any

import pytest

from marsproxy.sched.config import SchedulerConfig, SchedulerTuning
from marsproxy.sched.core import SchedulerCore
from marsproxy.sched.tickets import WorkerFacts


def make(workers: tuple[str, ...] = ("w",), kv_reserve_frac: float = 0.10,
         **kw: Any) -> SchedulerCore:
    """A core with ``kw`` set at either level (the tuning keys go under ``tuning``)."""
    tuned = {k: v for k, v in kw.items() if k in SchedulerTuning.model_fields}
    rest = {k: v for k, v in kw.items() if k not in tuned}
    cfg = SchedulerConfig(**rest, tuning=SchedulerTuning(**tuned))
    return SchedulerCore(cfg, list(workers), kv_reserve_frac)


def end_ok(core: SchedulerCore, now: float, call: int, prompt: int, completion: int = 10,
           cached: int = 0, tool: float | None = None, more: bool = True) -> Any:
    return core.end(now, call, ok=True, prompt_tokens=prompt, completion_tokens=completion,
                    cached_tokens=cached, engine_s=0.1, predicted_tool_s=tool,
                    session_continues=more)


# -- levels -------------------------------------------------------------------------------

def test_mars_level_is_uncached_bucket_and_warm_counts_only_new_tokens() -> None:
    core = make(retention_policy="mars")
    core.set_mode("w", "priority")
    core.set_facts("w", WorkerFacts(block_size=16, total_blocks=10_000,
                                    prefill_tokens_per_s=1_000.0))
    t = core.arrive(0.0, "s", "w", 6_000)
    assert (t.level, t.priority, t.warm, t.uncached_tokens) == (1, 1, False, 6_000)
    # 6_000 + 10 tokens at 1_000 tok/s = 6 s re-prefill > 2 s tool: retained for 2 s
    r = end_ok(core, 1.0, t.call, 6_000, tool=2.0)
    assert r.retention is not None and r.retention.retain and r.retention.ttl_s == 2.0
    assert core.retained_blocks("w") == 376  # ceil(6_010 / 16)
    # back within the TTL: warm, only 6_100 - 6_010 new tokens count → bucket 0, demoted
    # once for 6_010 tokens of attained service → level 1 (cold it would be 1 + 1 = 2) ...
    t2 = core.arrive(2.5, "s", "w", 6_100)
    assert (t2.warm, t2.uncached_tokens, t2.level) == (True, 90, 1)
    assert core.retained_blocks("w") == 0  # ... and the reservation goes on return


def test_mars_cold_after_ttl_and_demotion_by_attained_service() -> None:
    core = make()
    core.set_mode("w", "priority")
    core.set_facts("w", WorkerFacts(block_size=16, prefill_tokens_per_s=1_000.0))
    t = core.arrive(0.0, "s", "w", 1_000)
    assert t.level == 0
    end_ok(core, 1.0, t.call, 1_000, completion=1_500, tool=1.0)  # attained 2_500 > 2_048
    t2 = core.arrive(5.0, "s", "w", 1_100)  # TTL 1 s ended: cold, all 1_100 tokens count
    assert (t2.warm, t2.uncached_tokens) == (False, 1_100)
    assert t2.level == 1  # bucket 0, demoted once


def test_las_uses_only_attained_service() -> None:
    core = make(priority_policy="las")
    core.set_mode("w", "priority")
    t = core.arrive(0.0, "s", "w", 30_000)
    assert t.level == 0  # a long prompt of a fresh session is not demoted
    end_ok(core, 1.0, t.call, 30_000, completion=3_000)  # 33_000 attained: past all three
    assert core.arrive(2.0, "s", "w", 100).level == 3


def test_session_fcfs_orders_by_session_arrival_and_off_sends_nothing() -> None:
    core = make(priority_policy="session_fcfs")
    core.set_mode("w", "priority")
    a = core.arrive(0.0, "a", "w", 10)
    b = core.arrive(1.0, "b", "w", 10)
    a2 = core.arrive(2.0, "a", "w", 10)
    assert (a.level, a.priority, b.priority, a2.priority) == (None, 0, 1, 0)
    off = make(priority_policy="off")
    t = off.arrive(0.0, "a", "w", 10)
    assert (t.level, t.priority, t.gated, t.dispatched) == (None, None, False, True)


# -- gated dispatch -----------------------------------------------------------------------

def test_gated_releases_by_level_under_the_cap() -> None:
    core = make()
    core.set_facts("w", WorkerFacts(max_num_seqs=1, block_size=16))
    first = core.arrive(0.0, "x", "w", 100)
    assert core.release(0.0) == [first]
    long = core.arrive(0.1, "long", "w", 20_000)   # level 2
    short = core.arrive(0.2, "short", "w", 100)    # level 0, arrived later
    assert core.release(0.3) == []                  # cap 1 reached
    assert [t.session for t in core.queue(0.3, "w")] == ["short", "long"]
    end_ok(core, 1.0, first.call, 100)
    assert core.release(1.0) == [short]
    end_ok(core, 2.0, short.call, 100)
    assert core.release(2.0) == [long]
    assert long.waited_s() == pytest.approx(1.9)


def test_a_call_without_a_body_priority_waits_in_the_gate_of_a_priority_worker() -> None:
    # /v1/messages carries no priority vLLM reads: on a priority worker such a call is gated,
    # and the ungated calls running there count against the gate's cap.
    core = make()
    core.set_mode("w", "priority")
    core.set_facts("w", WorkerFacts(max_num_seqs=1, block_size=16))
    running = core.arrive(0.0, "chat", "w", 100)
    assert not running.gated and running.dispatched
    held = core.arrive(0.1, "messages", "w", 100, gate=True)
    assert held.gated and not held.dispatched and core.release(0.1) == []
    end_ok(core, 1.0, running.call, 100)
    assert core.release(1.0) == [held]


def test_aging_promotes_a_waiting_continuation() -> None:
    core = make(aging_period_s=10.0)
    core.set_facts("w", WorkerFacts(max_num_seqs=1))
    blocker = core.arrive(0.0, "b", "w", 10)
    core.release(0.0)
    old = core.arrive(0.0, "old", "w", 20_000)     # level 2
    new = core.arrive(25.0, "new", "w", 3_000)     # level 1
    # at 25 s the old one has aged two levels (2 → 0): it goes first
    end_ok(core, 25.0, blocker.call, 10)
    assert core.release(25.0) == [old]
    assert new.dispatched is False


def test_kv_gate_backfills_a_bounded_number_of_times() -> None:
    core = make(backfill_max=2, kv_reserve_frac=0.0)
    core.set_facts("w", WorkerFacts(max_num_seqs=100, total_blocks=100, block_size=16))
    running = core.arrive(0.0, "r", "w", 60 * 16)   # 60 blocks
    assert core.release(0.0) == [running]
    big = core.arrive(0.1, "big", "w", 50 * 16)     # level 0, 50 blocks: does not fit in 40
    smalls = [core.arrive(0.2 + i / 10, f"s{i}", "w", 5 * 16) for i in range(4)]
    out = core.release(1.0)
    assert out == smalls[:2]          # two pass the head, no more
    assert big.bypassed == 2
    assert core.release(1.1) == []    # still 50 > 100 - 70 and the bound is used up
    end_ok(core, 2.0, running.call, 60 * 16, more=False)
    assert core.release(2.0) == [big, *smalls[2:]]


def test_an_oversized_continuation_goes_when_the_worker_is_idle() -> None:
    core = make()
    core.set_facts("w", WorkerFacts(total_blocks=10, block_size=16))
    t = core.arrive(0.0, "s", "w", 10_000)
    assert core.release(0.0) == [t]


def test_gate_drops_dormant_reservations_before_holding_running_work() -> None:
    core = make(kv_reserve_frac=0.0)
    core.set_facts("w", WorkerFacts(total_blocks=100, block_size=16,
                                    prefill_tokens_per_s=100.0))
    # two dormant sessions hold 30 (level 0) and 30 (level 2) blocks
    for s, prompt in (("low", 20_000 // 16 * 0 + 470), ("high", 470)):
        t = core.arrive(0.0, s, "w", prompt)
        core.release(0.0)
        end_ok(core, 0.5, t.call, prompt, completion=10, tool=1.0)
    assert core.retained_blocks("w") == 60
    busy = core.arrive(0.6, "busy", "w", 30 * 16)
    core.release(0.6)
    assert busy.dispatched
    need = core.arrive(0.7, "need", "w", 20 * 16)  # 30 running + 20 > 100 - 60
    assert core.release(0.7) == [need]
    assert core.retained_blocks("w") == 30  # one reservation dropped, not both


def test_cancel_leaves_the_queue_and_frees_the_slot() -> None:
    core = make()
    core.set_facts("w", WorkerFacts(max_num_seqs=1))
    a = core.arrive(0.0, "a", "w", 10)
    core.release(0.0)
    b = core.arrive(0.0, "b", "w", 10)
    c = core.arrive(0.0, "c", "w", 10)
    assert core.cancel(b.call) is b
    assert core.cancel(a.call) is a
    assert core.release(0.1) == [c]
    assert core.cancel(a.call) is None


# -- retention, ledger, pressure ----------------------------------------------------------

def test_retention_off_and_fixed() -> None:
    off = make(retention_policy="off")
    off.set_facts("w", WorkerFacts(prefill_tokens_per_s=1.0, block_size=16))
    t = off.arrive(0.0, "s", "w", 1_000)
    r = end_ok(off, 1.0, t.call, 1_000, tool=0.5)
    assert r.retention is not None and not r.retention.retain and t.retain_s is None
    fixed = make(retention_policy="fixed", fixed_retention_s=2.0)
    fixed.set_facts("w", WorkerFacts(block_size=16))
    t = fixed.arrive(0.0, "s", "w", 160, predicted_tool_s=1.0)
    assert t.retain_s == 2.0
    r = end_ok(fixed, 1.0, t.call, 150, tool=1.5)
    assert r.retention is not None and r.retention.ttl_s == 2.0
    assert fixed.retained_blocks("w") == 10
    t2 = fixed.arrive(2.0, "s", "w", 170)
    r2 = end_ok(fixed, 3.0, t2.call, 170, tool=5.0)  # tool longer than 2 s: no retention
    assert r2.retention is not None and not r2.retention.retain


def test_no_retention_on_failure_or_final_turn() -> None:
    core = make()
    core.set_facts("w", WorkerFacts(prefill_tokens_per_s=1.0, block_size=16))
    t = core.arrive(0.0, "s", "w", 1_000)
    assert end_ok(core, 1.0, t.call, 1_000, tool=0.5, more=False).retention is None
    t = core.arrive(2.0, "s", "w", 1_000)
    r = core.end(3.0, t.call, ok=False, prompt_tokens=0, completion_tokens=0, cached_tokens=0,
                 engine_s=0.0, predicted_tool_s=0.5, session_continues=True)
    assert r.retention is None and core.retained_blocks("w") == 0


def test_tick_expires_and_drops_lowest_priority_first_under_kv_usage() -> None:
    core = make(retention_drop_kv_usage=0.9)
    core.set_facts("w", WorkerFacts(prefill_tokens_per_s=1.0, block_size=16, total_blocks=1000))
    calls = {}
    for s, prompt in (("short", 100), ("long", 10_000), ("mid", 3_000)):
        calls[s] = core.arrive(0.0, s, "w", prompt)
    for s, prompt, tool in (("short", 100, 50.0), ("long", 10_000, 100.0), ("mid", 3_000, 5.0)):
        end_ok(core, 1.0, calls[s].call, prompt, tool=tool)
    assert len(core.ledger) == 3
    res = core.tick(7.0)  # mid's 5 s TTL ended
    assert [r.session for r in res.expired] == ["mid"] and res.dropped == []
    core.set_facts("w", WorkerFacts(prefill_tokens_per_s=1.0, block_size=16, total_blocks=1000,
                                    kv_usage=0.95))
    res = core.tick(8.0)  # 50 blocks over: the least urgent ("long", level 3) goes first
    assert [r.session for r in res.dropped] == ["long"]
    assert [r.session for r in core.ledger.reservations()] == ["short"]


def test_resume_stats_count_warm_and_cold_by_retention() -> None:
    core = make()
    core.set_facts("w", WorkerFacts(prefill_tokens_per_s=10.0, block_size=16))
    t = core.arrive(0.0, "s", "w", 1_000)
    assert end_ok(core, 1.0, t.call, 1_000, completion=10, tool=5.0).resume is None
    t = core.arrive(2.0, "s", "w", 1_100)
    assert t.warm
    assert end_ok(core, 3.0, t.call, 1_100, cached=1_000, tool=5.0).resume == "warm"
    t = core.arrive(100.0, "s", "w", 1_200)  # TTL long gone
    assert not t.warm
    assert end_ok(core, 101.0, t.call, 1_200, cached=0, tool=5.0).resume == "cold"
    assert core.resumes.warm == {True: 1, False: 0}
    assert core.resumes.cold == {True: 0, False: 1}
    assert core.resumes.hit_rate == pytest.approx(0.5)
    assert core.resumes.cached_tokens == 1_000 and core.resumes.context_tokens == 2_120


def test_session_end_forgets_and_releases() -> None:
    core = make()
    core.set_facts("w", WorkerFacts(prefill_tokens_per_s=1.0, block_size=16))
    t = core.arrive(0.0, "s", "w", 1_000)
    end_ok(core, 1.0, t.call, 1_000, tool=5.0)
    assert core.session_ended("s") is not None
    assert core.retained_blocks("w") == 0 and core.service.attained("s") == 0.0


def test_queue_and_ledger_views() -> None:
    core = make()
    core.set_facts("w", WorkerFacts(max_num_seqs=1, prefill_tokens_per_s=1.0, block_size=16))
    a = core.arrive(0.0, "a", "w", 100)
    core.release(0.0)
    core.arrive(0.5, "b", "w", 100)
    end_ok(core, 1.0, a.call, 100, tool=5.0)
    assert core.modes["w"] == "gated" and core.cap("w") == 1 and core.in_flight("w") == 0
    assert [t.session for t in core.queue(1.0, "w")] == ["b"]
    assert [r.session for r in core.ledger.reservations("w")] == ["a"]


def test_a_later_class_runs_after_the_first() -> None:
    # The class rank comes before the level: in the gate, and in the engine's priority.
    core = make()
    core.yield_rank = lambda s: 1 if s.startswith("batch") else 0
    core.set_facts("w", WorkerFacts(max_num_seqs=1, block_size=16))
    first = core.arrive(0.0, "x", "w", 100)
    assert core.release(0.0) == [first]
    core.arrive(0.1, "batch", "w", 100)  # level 0, batch
    core.arrive(0.2, "inter", "w", 20_000)  # level 2, first class
    assert [t.session for t in core.queue(0.3, "w")] == ["inter", "batch"]
    core.set_mode("w", "priority")
    b, i = core.arrive(1.0, "batch2", "w", 100), core.arrive(1.0, "inter2", "w", 100)
    assert b.level == i.level == 0
    assert b.priority is not None and i.priority is not None and b.priority > i.priority


def test_a_later_class_call_leaves_room_for_the_first_classs_sessions() -> None:
    # The engine does not preempt for a waiting call: a batch call goes only beside what the
    # first class's sessions are forecast to hold, less what of it runs already.
    core = make(kv_reserve_frac=0.0)
    core.set_facts("w", WorkerFacts(max_num_seqs=8, block_size=16, total_blocks=100))
    core.set_mode("w", "priority")  # only the calls told to wait in the gate wait there
    core.yield_rank = lambda s: 1 if s.startswith("batch") else 0
    first = {"w": 0}
    core.protected_tokens = lambda w: first[w]
    big = core.arrive(0.0, "batch0", "w", 60 * 16, gate=True)  # 60 blocks
    assert core.release(0.0) == [big]  # nothing of the first class on the worker
    first["w"] = 31 * 16  # an interactive session forecast at 31 blocks, dormant
    nxt = core.arrive(0.1, "batch1", "w", 10 * 16, gate=True)  # 60 + 10 + 31 > 100
    assert core.release(0.1) == []
    i = core.arrive(0.2, "inter", "w", 20 * 16)  # runs 20 of its 31: 11 left to hold
    assert i.dispatched
    assert core.release(0.2) == []  # 60 + 20 + 10 + 11 > 100
    end_ok(core, 1.0, big.call, 60 * 16)
    assert core.release(1.0) == [nxt]


def _idle_worker_with_a_dormant_first_class_session() -> tuple[SchedulerCore, Any]:
    """A worker of 100 blocks; ``inter`` (first class, 40 blocks of context) and a batch
    session's call that took 0.5 s both ended at 1.0; the batch session comes back at 1.1."""
    core = make(kv_reserve_frac=0.0)
    core.set_facts("w", WorkerFacts(max_num_seqs=8, block_size=16, total_blocks=100))
    core.set_mode("w", "priority")
    core.yield_rank = lambda s: 1 if s.startswith("batch") else 0
    first = {"w": 0}
    core.protected_tokens = lambda w: first[w]
    b = core.arrive(0.5, "batch", "w", 60 * 16, gate=True)
    i = core.arrive(0.5, "inter", "w", 30 * 16)
    assert core.release(0.5) == [b] and i.dispatched
    core.end(1.0, b.call, ok=True, prompt_tokens=60 * 16, completion_tokens=16,
             cached_tokens=0, engine_s=0.5, predicted_tool_s=None, session_continues=True)
    end_ok(core, 1.0, i.call, 30 * 16, completion=10 * 16)  # context: 40 blocks
    first["w"] = 50 * 16  # its forecast peak: 50 blocks
    return core, core.arrive(1.1, "batch", "w", 61 * 16, gate=True)  # 61 + 50 > 100


def test_a_yielding_call_waits_on_an_idle_worker_for_a_session_due_back() -> None:
    # The engine does not preempt a running call for a waiting one: sent now, the batch call
    # (about 0.5 s, as its last) would hold the interactive session's next call back. It waits
    # until that session has been away as long (1.0 + 0.5), then goes: the engine idles at most
    # as long as the batch call would have held the other back.
    core, t = _idle_worker_with_a_dormant_first_class_session()
    assert core.release(1.1) == [] and core.next_release_at() == pytest.approx(1.5)
    assert core.release(1.5) == [t] and core.next_release_at() is None


def test_the_session_due_back_comes_back_and_runs_first() -> None:
    core, t = _idle_worker_with_a_dormant_first_class_session()
    assert core.release(1.2) == []
    i = core.arrive(1.3, "inter", "w", 41 * 16)
    assert i.dispatched and core.release(1.3) == []  # 41 running + 61 > 100
    end_ok(core, 1.6, i.call, 41 * 16)  # dormant again: the batch call waits anew
    assert core.release(1.6) == [] and core.next_release_at() == pytest.approx(2.1)
    assert core.release(2.1) == [t]  # away 0.5 s: the batch call goes


def test_no_wait_for_a_session_due_back_beside_which_the_call_fits() -> None:
    core, t = _idle_worker_with_a_dormant_first_class_session()
    core.cancel(t.call)
    small = core.arrive(1.1, "batch", "w", 59 * 16, gate=True)  # 59 + 40 fits; 59 + 50 not
    assert core.release(1.1) == [small]


def test_a_first_call_or_a_first_class_call_does_not_wait_for_a_session_due_back() -> None:
    core, t = _idle_worker_with_a_dormant_first_class_session()
    core.cancel(t.call)
    first = core.arrive(1.1, "batch-new", "w", 61 * 16, gate=True)  # no call time to go by
    assert core.release(1.1) == [first]
    core.cancel(first.call)
    core.yield_rank = lambda s: 0  # nobody yields: the idle worker takes the call
    again = core.arrive(1.2, "batch", "w", 61 * 16, gate=True)
    assert core.release(1.2) == [again]
