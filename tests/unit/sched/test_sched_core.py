"""The scheduler core: order per policy, cancel, retention into the ledger, release on return,
expiry and drops under pressure, resume stats (the dispatch gate: test_sched_gate.py)."""

from __future__ import annotations

import pytest

from marsproxy.sched.tickets import WorkerFacts

from .core_helpers import end_ok, make

# -- order --------------------------------------------------------------------------------

def test_a_continuation_back_within_its_ttl_is_warm() -> None:
    core = make(retention_policy="mars")
    core.set_mode("w", "priority")
    core.set_facts("w", WorkerFacts(block_size=16, total_blocks=10_000,
                                    prefill_tokens_per_s=1_000.0))
    t = core.arrive(0.0, "s", "w", 6_000)
    assert (t.level, t.priority, t.warm, t.uncached_tokens) == (None, 0, False, 6_000)
    # 6_000 + 10 tokens at 1_000 tok/s = 6 s re-prefill > 2 s tool: retained for 2 s
    r = end_ok(core, 1.0, t.call, 6_000, tool=2.0)
    assert r.retention is not None and r.retention.retain and r.retention.ttl_s == 2.0
    assert core.retained_blocks("w") == 376  # ceil(6_010 / 16)
    # back within the TTL: warm, only 6_100 - 6_010 tokens to prefill ...
    t2 = core.arrive(2.5, "s", "w", 6_100)
    assert (t2.warm, t2.uncached_tokens, t2.priority) == (True, 90, 0)
    assert core.retained_blocks("w") == 0  # ... and the reservation goes on return


def test_a_continuation_back_after_its_ttl_is_cold() -> None:
    core = make()
    core.set_facts("w", WorkerFacts(block_size=16, prefill_tokens_per_s=1_000.0))
    t = core.arrive(0.0, "s", "w", 1_000)
    end_ok(core, 1.0, t.call, 1_000, completion=1_500, tool=1.0)
    t2 = core.arrive(5.0, "s", "w", 1_100)  # TTL 1 s ended: cold, all 1_100 tokens count
    assert (t2.warm, t2.uncached_tokens) == (False, 1_100)
    assert len(core.service) == 0  # attained service is kept for las alone


def test_las_uses_only_attained_service() -> None:
    core = make(priority_policy="las")
    core.set_mode("w", "priority")
    t = core.arrive(0.0, "s", "w", 30_000)
    assert t.level == 0  # a long prompt of a fresh session is not demoted
    end_ok(core, 1.0, t.call, 30_000, completion=3_000)  # 33_000 attained: past all three
    assert core.arrive(2.0, "s", "w", 100).level == 3


def test_session_fcfs_orders_by_session_arrival_and_off_sends_nothing() -> None:
    core = make()  # session_fcfs, the default
    core.set_mode("w", "priority")
    a = core.arrive(0.0, "a", "w", 10)
    b = core.arrive(1.0, "b", "w", 10)
    a2 = core.arrive(2.0, "a", "w", 10)
    assert (a.level, a.priority, b.priority, a2.priority) == (None, 0, 1, 0)
    off = make(priority_policy="off")
    t = off.arrive(0.0, "a", "w", 10)
    assert (t.level, t.priority, t.gated, t.dispatched) == (None, None, False, True)


@pytest.mark.parametrize("policy", ["session_fcfs", "las"])
def test_a_yielding_session_runs_after_every_other_session(policy: str) -> None:
    core = make(priority_policy=policy)
    core.set_mode("w", "priority")
    core.yield_rank = lambda s: 1 if s.startswith("batch") else 0
    batch = core.arrive(0.0, "batch", "w", 10)
    late = [core.arrive(1.0, f"s{i}", "w", 40_000) for i in range(50)]
    end_ok(core, 2.0, late[-1].call, 40_000, completion=1_000)  # las: demoted to level 3
    assert all(t.priority is not None and batch.priority is not None
               and t.priority < batch.priority for t in late)
    assert core.arrive(3.0, "s49", "w", 41_000).priority < batch.priority  # type: ignore[operator]


# -- cancel ---------------------------------------------------------------------------------

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


def test_an_ejected_workers_held_calls_leave_its_gate() -> None:
    core = make(workers=("w", "v"))
    for w in ("w", "v"):
        core.set_facts(w, WorkerFacts(max_num_seqs=1))
    running = core.arrive(0.0, "a", "w", 10)
    core.release(0.0)
    held = [core.arrive(0.0, s, "w", 10) for s in ("b", "c")]
    other = core.arrive(0.0, "d", "v", 10)
    assert core.evict("w") == held
    assert core.queue_length("w") == 0 and core.in_flight("w") == 1  # the running call stays
    assert [core.cancel(t.call) for t in held] == [None, None]  # gone: nothing to free twice
    assert core.cancel(running.call) is running and core.release(0.1) == [other]


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
    core = make(priority_policy="las", retention_drop_kv_usage=0.9)
    core.set_facts("w", WorkerFacts(prefill_tokens_per_s=1.0, block_size=16, total_blocks=1000))
    first = core.arrive(0.0, "long", "w", 10_000)
    end_ok(core, 0.1, first.call, 10_000, tool=0.0, more=True)  # 10_010 attained: level 2 next
    calls = {}
    for s, prompt in (("short", 100), ("long", 10_000), ("mid", 3_000)):
        calls[s] = core.arrive(0.2, s, "w", prompt)
    assert (calls["long"].level, calls["short"].level) == (2, 0)
    for s, prompt, tool in (("short", 100, 50.0), ("long", 10_000, 100.0), ("mid", 3_000, 5.0)):
        end_ok(core, 1.0, calls[s].call, prompt, tool=tool)
    assert len(core.ledger) == 3
    res = core.tick(7.0)  # mid's 5 s TTL ended
    assert [r.session for r in res.expired] == ["mid"] and res.dropped == []
    core.set_facts("w", WorkerFacts(prefill_tokens_per_s=1.0, block_size=16, total_blocks=1000,
                                    kv_usage=0.95))
    res = core.tick(8.0)  # 50 blocks over: the least urgent ("long", level 2) goes first
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
    core = make(priority_policy="las")
    core.set_facts("w", WorkerFacts(prefill_tokens_per_s=1.0, block_size=16))
    t = core.arrive(0.0, "s", "w", 1_000)
    end_ok(core, 1.0, t.call, 1_000, tool=5.0)
    assert core.service.attained("s") == 1_010.0
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
