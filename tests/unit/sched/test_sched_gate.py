"""The scheduler core's dispatch gate: release in order under the cap, the KV fit of calls
that yield and its backfill bound, aging, a later class's room, and the wait for a session due
back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from marsproxy.sched.core import SchedulerCore
from marsproxy.sched.tickets import WorkerFacts

from .core_helpers import end_ok, make


def test_gated_releases_in_session_order_under_the_cap() -> None:
    core = make()
    core.set_facts("w", WorkerFacts(max_num_seqs=1, block_size=16))
    early = core.arrive(0.0, "early", "w", 100)
    assert core.release(0.0) == [early]
    end_ok(core, 0.5, early.call, 100)
    x = core.arrive(0.6, "x", "w", 100)
    assert core.release(0.6) == [x]
    late = core.arrive(0.7, "late", "w", 100)
    back = core.arrive(0.8, "early", "w", 200)  # the earliest session, back from its tool
    assert core.release(0.9) == []                  # cap 1 reached
    assert [t.session for t in core.queue(0.9, "w")] == ["early", "late"]
    end_ok(core, 1.0, x.call, 100)
    assert core.release(1.0) == [back]
    end_ok(core, 2.0, back.call, 200)
    assert core.release(2.0) == [late]
    assert late.waited_s() == pytest.approx(1.3)


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
    core = make(priority_policy="las", aging_period_s=10.0)
    core.set_facts("w", WorkerFacts(max_num_seqs=1))
    blocker = core.arrive(0.0, "b", "w", 10)
    core.release(0.0)
    core.service.add("old", 10_000)
    core.service.add("new", 3_000)
    old = core.arrive(0.0, "old", "w", 100)         # level 2
    new = core.arrive(25.0, "new", "w", 100)        # level 1
    assert (old.level, new.level) == (2, 1)
    # at 25 s the old one has aged two levels (2 → 0): it goes first
    end_ok(core, 25.0, blocker.call, 10)
    assert core.release(25.0) == [old]
    assert new.dispatched is False


def yielding(**kw: Any) -> SchedulerCore:
    """A core whose every session yields (a later class's): their calls wait for KV."""
    core = make(**kw)
    core.yield_rank = lambda _s: 1
    return core


def test_a_call_that_yields_to_nobody_is_held_by_the_cap_alone() -> None:
    # Admission keeps the sessions' forecast peaks within the cache and the engine takes a
    # call when it has the blocks, as without the proxy: holding calls for KV too cost every
    # twin (gated KV 1024: 1.80x direct against 2.43x).
    core = make(kv_reserve_frac=0.1)
    core.set_facts("w", WorkerFacts(max_num_seqs=3, total_blocks=100, block_size=16))
    calls = [core.arrive(0.0, f"s{i}", "w", 60 * 16) for i in range(4)]
    assert core.release(0.0) == calls[:3]  # 180 blocks of prompts on 100: the engine's to run
    assert not calls[3].dispatched  # the cap (max_num_seqs) holds
    end_ok(core, 1.0, calls[0].call, 60 * 16)
    assert core.release(1.0) == [calls[3]]


def test_kv_gate_backfills_a_bounded_number_of_times() -> None:
    core = yielding(backfill_max=2, kv_reserve_frac=0.0)
    core.set_facts("w", WorkerFacts(max_num_seqs=100, total_blocks=100, block_size=16))
    running = core.arrive(0.0, "r", "w", 60 * 16)   # 60 blocks
    assert core.release(0.0) == [running]
    big = core.arrive(0.1, "big", "w", 50 * 16)     # first in order, 50 blocks: not in 40
    smalls = [core.arrive(0.2 + i / 10, f"s{i}", "w", 5 * 16) for i in range(4)]
    out = core.release(1.0)
    assert out == smalls[:2]          # two pass the head, no more
    assert big.bypassed == 2
    assert core.release(1.1) == []    # still 50 > 100 - 70 and the bound is used up
    end_ok(core, 2.0, running.call, 60 * 16, more=False)
    assert core.release(2.0) == [big, *smalls[2:]]


def test_a_call_counts_its_sessions_last_output_within_max_tokens_not_max_tokens() -> None:
    # The engine allocates output blocks as it decodes: a client's max_tokens (agents send
    # 4k-32k) is a bound, not a size. Counted in full, two calls of 10 blocks with max_tokens
    # 4096 could not run side by side on 100 blocks (calls that yield are held for KV).
    core = yielding(kv_reserve_frac=0.0)
    core.set_facts("w", WorkerFacts(max_num_seqs=100, total_blocks=100, block_size=16))
    first = [core.arrive(0.0, f"s{i}", "w", 10 * 16, max_new_tokens=4096) for i in range(9)]
    assert [t.blocks for t in first] == [10] * 9  # a first call: its prompt alone
    assert core.release(0.0) == first
    end_ok(core, 1.0, first[0].call, 10 * 16, completion=30 * 16)
    again = core.arrive(2.0, "s0", "w", 40 * 16, max_new_tokens=4096)
    assert again.blocks == 70  # its context and what its last call wrote
    assert core.release(2.0) == []  # 80 run: 70 more do not fit
    end_ok(core, 3.0, first[1].call, 10 * 16, completion=30 * 16)
    capped = core.arrive(4.0, "s1", "w", 40 * 16, max_new_tokens=5 * 16)
    assert capped.blocks == 45  # max_tokens bounds the output: 40 + 5


def test_an_oversized_continuation_goes_when_the_worker_is_idle() -> None:
    core = make()
    core.set_facts("w", WorkerFacts(total_blocks=10, block_size=16))
    t = core.arrive(0.0, "s", "w", 10_000)
    assert core.release(0.0) == [t]


def test_gate_drops_dormant_reservations_before_holding_running_work() -> None:
    core = yielding(kv_reserve_frac=0.0)
    core.set_facts("w", WorkerFacts(total_blocks=100, block_size=16,
                                    prefill_tokens_per_s=100.0))
    # two dormant sessions hold 30 blocks each
    for s, prompt in (("a", 470), ("b", 470)):
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


def test_a_later_class_runs_after_the_first() -> None:
    # The class rank comes before the session order: in the gate and in the engine's priority.
    core = make()
    core.yield_rank = lambda s: 1 if s.startswith("batch") else 0
    core.set_facts("w", WorkerFacts(max_num_seqs=1, block_size=16))
    first = core.arrive(0.0, "x", "w", 100)
    assert core.release(0.0) == [first]
    core.arrive(0.1, "batch", "w", 100)  # arrived first, batch
    core.arrive(0.2, "inter", "w", 100)  # arrived later, first class
    assert [t.session for t in core.queue(0.3, "w")] == ["inter", "batch"]
    core.set_mode("w", "priority")
    b, i = core.arrive(1.0, "batch2", "w", 100), core.arrive(1.0, "inter2", "w", 100)
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


def _tenants(max_num_seqs: int, *, yielding: Callable[[str], bool], tasks: str,
             protected_blocks: int) -> SchedulerCore:
    """A priority worker of 100 blocks; the sessions ``yielding`` is true of yield, those named
    ``tasks``... are one-shot tasks, and who they yield to is forecast ``protected_blocks``."""
    core = make(kv_reserve_frac=0.0)
    core.set_facts("w", WorkerFacts(max_num_seqs=max_num_seqs, block_size=16, total_blocks=100))
    core.set_mode("w", "priority")
    core.yield_rank = lambda s: int(yielding(s))
    core.one_shot = lambda s: s.startswith(tasks)
    core.protected_tokens = lambda w: protected_blocks * 16
    return core


def test_a_one_shot_tasks_call_waits_for_the_cap_alone() -> None:
    # A one-shot task (its tenant's sessions never come back) holds its KV only while it runs:
    # its call is not held for KV, even where it yields (the engine queues what its cache
    # cannot take, as with no proxy), so a batch key's tasks are not held to a few at once
    # beside a few agents. A yielding call of a session that returns is still held.
    core = _tenants(3, yielding=lambda s: s.startswith("batch"), tasks="batch-task",
                    protected_blocks=80)  # the agents' forecasts
    running = core.arrive(0.0, "inter", "w", 10 * 16)  # an agent's call runs (10 of its 80)
    assert running.dispatched
    held = core.arrive(0.1, "batch-agent", "w", 30 * 16, gate=True)  # 10 + 30 + 70 > 100
    tasks = [core.arrive(0.1, f"batch-task{i}", "w", 60 * 16, gate=True) for i in range(3)]
    assert core.release(0.1) == tasks[:2]  # 130 blocks beside 10: only the cap (3) holds
    assert not held.dispatched and not tasks[2].dispatched
    core.one_shot = lambda s: False  # were they sessions that return, they would wait
    end_ok(core, 0.5, tasks[0].call, 60 * 16)
    end_ok(core, 0.5, tasks[1].call, 60 * 16)
    again = core.arrive(0.6, "batch-task3", "w", 30 * 16, gate=True)
    assert core.release(0.6) == [] and not again.dispatched


def test_a_yielding_call_does_not_wait_for_one_shot_tasks_calls() -> None:
    # Two tenants over their share beside a light one: a batch key's tasks and a heavy agents'
    # key. The tasks' calls are never held for KV; were the heavy key's held until they fit
    # beside them, it would yield to the tasks (which yield too) and not only to the light
    # tenant. Beside the tasks' calls the heavy call leaves the light tenant's forecast room
    # and goes; beside a returning session's call of the same size it waits.
    core = _tenants(8, yielding=lambda s: not s.startswith("light"), tasks="task",
                    protected_blocks=40)  # the light tenant's forecast
    tasks = [core.arrive(0.0, f"task{i}", "w", 25 * 16, gate=True) for i in range(2)]
    assert core.release(0.0) == tasks  # 50 blocks of tasks
    heavy = core.arrive(0.1, "heavy", "w", 30 * 16, gate=True)  # 30 + 40 <= 100 beside them
    assert heavy.dispatched or core.release(0.1) == [heavy]
    end_ok(core, 0.5, heavy.call, 30 * 16)
    for t in tasks:
        end_ok(core, 0.5, t.call, 25 * 16)
    agent = core.arrive(0.6, "agent", "w", 50 * 16, gate=True)  # a returning session's call
    assert agent.dispatched or core.release(0.6) == [agent]
    again = core.arrive(0.7, "heavy", "w", 30 * 16, gate=True)  # 50 + 30 + 40 > 100: waits
    assert core.release(0.7) == [] and not again.dispatched


def test_a_light_keys_running_tasks_leave_the_protected_sessions_room_whole() -> None:
    # The protected forecasts leave one-shot tasks out (PeakForecast.committed_tokens): the
    # tasks' running calls (a light batch key's, yielding to nobody) are no part of what the
    # protected sessions already run, so a heavy call still leaves the light agent's 40 blocks.
    core = _tenants(8, yielding=lambda s: s.startswith("heavy"), tasks="task",
                    protected_blocks=40)  # a light agent's forecast, dormant
    tasks = [core.arrive(0.0, f"task{i}", "w", 25 * 16, gate=True) for i in range(2)]
    assert all(t.dispatched for t in tasks) or core.release(0.0) == tasks
    heavy = core.arrive(0.1, "heavy", "w", 70 * 16, gate=True)  # 70 + 40 > 100: waits
    assert core.release(0.1) == [] and not heavy.dispatched
    small = core.arrive(0.2, "heavy2", "w", 50 * 16, gate=True)  # 50 + 40 <= 100: backfills
    assert small.dispatched or small in core.release(0.2)


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
