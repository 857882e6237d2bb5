"""The invariant checkers flag broken states and pass sound ones."""

from __future__ import annotations

from marsproxy.aimd.admission import AdmissionCore, WorkerSignals
from marsproxy.aimd.config import AdmissionConfig, AdmissionTuning
from marsproxy.runs.results import RunResult, SessionOutcome, TurnOutcome
from marsproxy.sched.config import SchedulerConfig
from marsproxy.sched.core import SchedulerCore
from marsproxy.sim.invariants import (
    check_drained,
    check_outcomes,
    check_tick,
    light_load,
    light_load_violations,
)

ROOMY = WorkerSignals(kv_usage=0.0, free_blocks=1000, total_blocks=1000, block_size=16,
                      running=0)
NOTHING_LEFT = {"held_agents": 0, "gated_calls": 0}


def _waiting_core(cfg: AdmissionConfig | None = None) -> AdmissionCore:
    # Before the first tick every worker is unseen (stale): the session has to wait.
    core = AdmissionCore(cfg or AdmissionConfig(), ["w0", "w1"])
    assert core.on_request(0.0, "s1", "t", 800).kind == "wait"
    return core


def test_a_flags_a_waiting_session_beside_a_worker_with_room() -> None:
    core = _waiting_core()
    assert check_tick(0.0, core) == []  # nobody can take it: waiting is right
    # A core that took in fresh signals but skipped its admission pass (the bug to catch).
    core._signals["w1"] = ROOMY
    found = check_tick(0.2, core)
    assert [v.rule for v in found] == ["a"]
    assert "s1" in found[0].what and "w1" in found[0].what and found[0].at_s == 0.2
    # The real tick admits it: nothing to flag.
    core.tick(0.2, {"w0": ROOMY, "w1": ROOMY})
    assert len(core.queue) == 0 and check_tick(0.2, core) == []


def test_a_lets_a_session_wait_where_admitting_it_would_overload() -> None:
    core = AdmissionCore(AdmissionConfig(), ["w0"])
    core.tick(0.0, {"w0": ROOMY})
    assert core.on_request(0.0, "s0", "t", 800).kind == "admitted"
    full = WorkerSignals(kv_usage=0.99, free_blocks=10, total_blocks=1000, block_size=16,
                         running=1)
    core.tick(0.2, {"w0": full})
    assert core.on_request(0.2, "s1", "t", 800).kind == "wait"
    assert check_tick(0.2, core) == []  # KV overloaded, and 50 blocks do not fit 10
    # Out of overload, but the prompt (50 blocks) does not fit what the reserve leaves.
    tight = WorkerSignals(kv_usage=0.5, free_blocks=120, total_blocks=1000, block_size=16)
    for t in (0.4, 0.6):
        core.tick(t, {"w0": tight})
    assert not core.controllers["w0"].kv_overloaded and len(core.queue) == 1
    assert check_tick(0.6, core) == []


def test_b_flags_a_session_bypassed_past_the_bound() -> None:
    core = _waiting_core(AdmissionConfig(tuning=AdmissionTuning(max_bypass=1)))
    later = [core.queue.entry(f"s{i}", "t", 1.0, 10) for i in (2, 3)]
    for e in later:
        assert core.queue.push(e)
        core.queue.remove(e.session)
    core.queue._index.note_admitted(later)  # two later arrivals went ahead of s1
    found = check_tick(1.0, core)
    assert [v.rule for v in found] == ["b"] and "bypassed 2 times" in found[0].what


def _outcome(sid: str, e2e: float | None, status: int = 200, error: str = "") -> SessionOutcome:
    o = SessionOutcome(sid, 0.0, 1.0, 1, error=error)
    o.turns.append(TurnOutcome(0.0, None, e2e or 1.0, status))
    o.end_s = e2e if status == 200 else None
    return o


def test_b_accepts_documented_refusals_only() -> None:
    res = RunResult("mars", "", "", outcomes=[
        _outcome("ok", 3.0),
        _outcome("late", None, 503, "queue_deadline"),
        _outcome("full", None, 429, "queue_full"),
        _outcome("odd", None, 429, "queue_deadline"),  # the wrong status for that reason
        _outcome("lost", None, 200, "unfinished at the simulation horizon"),
    ])
    assert sorted(v.what.split()[1] for v in check_outcomes(res)) == ["lost", "odd"]


def test_c_compares_mean_and_p95_on_the_same_sessions() -> None:
    direct = RunResult("direct", "", "", outcomes=[_outcome(f"s{i}", 10.0) for i in range(4)])
    close = RunResult("mars", "", "", outcomes=[_outcome(f"s{i}", 10.2) for i in range(4)])
    ratio = light_load(direct, close)
    found = light_load_violations(ratio, close.policy, 0.03)
    assert found == [] and ratio is not None and abs(ratio.worst - 1.02) < 1e-9
    # One slow session: the mean stays within 3 %, the P95 does not.
    tail = RunResult("mars", "", "", outcomes=[
        *[_outcome(f"s{i}", 10.0) for i in range(3)], _outcome("s3", 11.0)])
    ratio = light_load(direct, tail)
    found = light_load_violations(ratio, tail.policy, 0.03)
    assert ratio is not None and ratio.mean_ratio < 1.03 < ratio.p95_ratio
    assert [v.rule for v in found] == ["c"]
    # A session the proxy refused where direct finished it is never within bounds.
    refused = RunResult("mars", "", "", outcomes=[
        *[_outcome(f"s{i}", 10.0) for i in range(3)], _outcome("s3", None, 503,
                                                                "queue_deadline")])
    ratio = light_load(direct, refused)
    found = light_load_violations(ratio, refused.policy, 0.03)
    assert ratio is not None and ratio.unfinished == 1 and [v.rule for v in found] == ["c"]


def test_d_flags_a_leaked_promise_and_queue_entry() -> None:
    core = AdmissionCore(AdmissionConfig(), ["w0"])
    core.tick(0.0, {"w0": ROOMY})
    assert core.on_request(0.0, "s1", "t", 800, final=True).kind == "admitted"
    assert core.promised() == (1, 50)  # its first prompt is not served yet
    core.on_response_end(1.0, "s1", prompt_tokens=800)
    assert check_drained(core, None, NOTHING_LEFT) == []
    # A promise nobody settles (the bug to catch), and a session left in the queue.
    core.gauge.promise("s2", "w0", 7)
    core.queue.push(core.queue.entry("s3", "t", 2.0, 10))
    found = {v.what for v in check_drained(core, None, NOTHING_LEFT, 9.0)}
    assert found == {"pending block promises: 1 left at the end",
                     "promised blocks: 7 left at the end",
                     "admission queue entries: 1 left at the end"}


def test_d_flags_scheduler_reservations_and_run_leftovers() -> None:
    sched = SchedulerCore(SchedulerConfig(), ["w0"], 0.10)
    sched.ledger.reserve("s1", "w0", 12, 0.0, 60.0, 0)
    found = check_drained(None, sched, {"held_agents": 1, "gated_calls": 0})
    assert sorted(v.what for v in found) == ["held agents: 1 left at the end",
                                             "scheduler reserved blocks: 12 left at the end"]
    sched.session_ended("s1")
    assert check_drained(None, sched, NOTHING_LEFT) == []
