"""The simulator on small workloads: deterministic, and each mechanism visibly at work."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from marsproxy.config import MarsConfig
from marsproxy.emulator.profiles import get_profile
from marsproxy.runs import options
from marsproxy.runs.arrivals import ArrivalSpec
from marsproxy.runs.results import RunResult, percentile
from marsproxy.runs.trace import load_trace
from marsproxy.runs.workload import Workload, WorkloadSpec, build_workload
from marsproxy.sim.harness import SimSetup, Simulation

SETUP = SimSetup(profile=get_profile("tiny", num_blocks=384), tool_cpus=2, system_prompt_tokens=60)


def _workload(sessions: int = 12, tool_scale: float = 0.01) -> Workload:
    return build_workload(load_trace(), WorkloadSpec(
        sessions=sessions, seed=0, token_scale=0.1, tool_time_scale=tool_scale, max_turns=6,
        max_context_tokens=5000, arrivals=ArrivalSpec("poisson", 0.0)))


def _cfg(policy: str) -> MarsConfig | None:
    if policy == "direct":
        return None
    return options.proxy_config(policy, options.parse_sets([]), ["http://w0"])


@pytest.mark.parametrize("policy", ["direct", "fcfs", "autellix", "continuum", "mars"])
def test_every_session_finishes_and_runs_repeat_exactly(policy: str) -> None:
    wl = _workload()
    a = Simulation(wl, policy, SETUP, _cfg(policy)).run()
    b = Simulation(wl, policy, SETUP, _cfg(policy)).run()
    assert all(o.ok for o in a.outcomes), [o.error for o in a.outcomes]
    assert [o.end_s for o in a.outcomes] == [o.end_s for o in b.outcomes]
    for o, plan in zip(a.outcomes, wl.sessions, strict=True):
        assert len(o.turns) == len(plan.turns)
        assert o.e2e_s is not None and o.e2e_s >= o.ideal_s * 0.999


def test_admission_holds_sessions_when_kv_is_short() -> None:
    res = Simulation(_workload(), "mars", SETUP, _cfg("mars")).run()
    queue = res.timeline["queue"]
    assert max(v for _, v in queue) >= 6  # most of the 12 waited for a slot
    assert queue[-1][1] == 0
    assert res.extra["stats"]["retained"] > 0


def test_forecast_peak_fit_keeps_the_cache_from_overflowing() -> None:
    # With the fit from the first session on, only what fits at its forecast peak is admitted:
    # (almost) no preemption, so the window never collapses. With the first-prompt fit alone,
    # admitted contexts outgrow the cache: preemptions, and the window moves. (Idle admission
    # and cheap preemption, the fit's exceptions, are off: this is about the fit.)
    def run(fit: str) -> RunResult:
        cfg = options.proxy_config("mars", options.parse_sets(
            [f"admission.tuning.kv_fit_peak={fit}", "admission.tuning.peak_free_sessions=0",
             "admission.tuning.peak_cheap_sessions=0", "admission.tuning.idle_admit=false"]),
            ["http://w0"])
        return Simulation(_workload(), "mars", SETUP, cfg).run()

    fit, first = run("true"), run("false")
    assert 4 * fit.extra["stats"]["preemptions"] < first.extra["stats"]["preemptions"]
    assert not fit.timeline["window"] and first.timeline["window"]
    direct = Simulation(_workload(), "direct", SETUP, None).run()
    # direct thrashes the 384-block cache: KV is lost between calls, admission keeps it (with
    # the first-prompt fit alone, what the preemptions leave)
    for res, margin in ((fit, 0.2), (first, 0.1)):
        assert res.summary().warm_resume_rate > direct.summary().warm_resume_rate + margin
        assert res.summary().mean_s < direct.summary().mean_s


def test_tools_contend_for_the_tool_cpus() -> None:
    wl = _workload(sessions=8, tool_scale=1.0)
    one = Simulation(wl, "direct", dataclasses.replace(SETUP, tool_cpus=1), None).run()
    many = Simulation(wl, "direct", dataclasses.replace(SETUP, tool_cpus=64), None).run()
    assert one.summary().mean_s > 1.5 * many.summary().mean_s


def test_scheduling_goes_through_the_scheduler_core() -> None:
    wl = _workload()
    fcfs = Simulation(wl, "fcfs", SETUP, _cfg("fcfs"))
    assert fcfs.sched is None  # the gateway's shell is passive for the fcfs preset
    assert fcfs.engines["w0"].policy == "fcfs"
    mars = Simulation(wl, "mars", SETUP, _cfg("mars"))
    assert mars.sched is not None and mars.sched.modes["w0"] == "priority"
    assert mars.engines["w0"].policy == "priority"
    res = mars.run()
    core = mars.sched
    # every call went through the core, in session order, resumes counted at each call's end
    calls = sum(len(p.turns) for p in wl.sessions)
    assert core.dispatched_total["w0"] == calls and not any(core.levels_total.values())
    assert core.resumes.resumes == calls - len(wl.sessions)
    assert core.resumes.warm[True] > 0  # retained prefixes came back warm
    assert res.extra["stats"]["retained"] > 0
    assert core.retained_blocks("w0") == 0 and core.in_flight("w0") == 0  # all forgotten


def test_continuum_orders_continuations_by_session_arrival() -> None:
    sim = Simulation(_workload(sessions=4), "continuum", SETUP, _cfg("continuum"))
    assert sim.sched is not None
    sim.run()
    # session_fcfs: the body priority is the session's arrival number at the scheduler
    assert sim.sched.levels_total == dict.fromkeys(sim.sched.levels_total, 0)  # no levels
    assert sim.engines["w0"].policy == "priority"


def test_gated_workers_order_continuations_in_the_proxy() -> None:
    # An engine that runs two calls at a time (max_num_seqs): the gate holds the rest.
    prof = get_profile("tiny", num_blocks=384, max_num_seqs=2)
    gated = dataclasses.replace(SETUP, worker_mode="gated", profile=prof)
    wl = _workload()
    sim = Simulation(wl, "mars", gated, _cfg("mars"))
    assert sim.engines["w0"].policy == "fcfs"  # the engine is FCFS; the gate orders
    res = sim.run()
    assert all(o.ok for o in res.outcomes), [o.error for o in res.outcomes]
    assert sim.sched is not None
    assert sim.sched.dispatched_total["w0"] == sum(len(p.turns) for p in wl.sessions)
    assert sim.sched.queue_length("w0") == 0
    assert res.extra["stats"]["gate_waits"] > 0  # the cap made the gate hold some
    again = Simulation(wl, "mars", gated, _cfg("mars")).run()
    assert [o.end_s for o in res.outcomes] == [o.end_s for o in again.outcomes]


def test_time_scale_stretches_llm_time_only() -> None:
    wl = _workload(sessions=1, tool_scale=0.0)
    fast = Simulation(wl, "direct", SETUP, None).run().outcomes[0]
    slow = Simulation(wl, "direct", dataclasses.replace(SETUP, time_scale=2.0), None).run()
    assert slow.outcomes[0].e2e_s == pytest.approx(2 * (fast.e2e_s or 0), rel=1e-6)


def test_call_overhead_delays_every_call_after_the_first() -> None:
    # One session alone: each of its calls after the first reaches the proxy 50 ms after its
    # tool phase, so it ends (turns - 1) x 50 ms later, with or without the proxy's core.
    wl = _workload(sessions=1, tool_scale=1.0)
    turns = len(wl.sessions[0].turns)
    assert turns > 1
    slow = dataclasses.replace(SETUP, call_overhead_s=0.05)
    for policy, cfg in (("direct", None), ("mars", _cfg("mars"))):
        base = Simulation(wl, policy, SETUP, cfg).run().outcomes[0]
        late = Simulation(wl, policy, slow, cfg).run().outcomes[0]
        assert late.ok and late.turns[0].sent_s == base.turns[0].sent_s
        assert (late.e2e_s or 0) - (base.e2e_s or 0) == pytest.approx(0.05 * (turns - 1))


def test_busy_cpus_slow_the_tools_only() -> None:
    # One session alone: with 1.5 of its 2 cores busy elsewhere its tools get half a core, so
    # each tool phase takes twice its time and the session ends exactly its tool time later.
    wl = _workload(sessions=1, tool_scale=1.0)
    tool_s = wl.sessions[0].tool_s_total
    assert tool_s > 0
    free = Simulation(wl, "direct", SETUP, None).run().outcomes[0]
    busy = Simulation(wl, "direct", dataclasses.replace(SETUP, busy_cpus=1.5), None).run()
    assert (busy.outcomes[0].e2e_s or 0) - (free.e2e_s or 0) == pytest.approx(tool_s, rel=1e-6)
    # The proxy still counts every core: its tool backlog reads against tool_cpus.
    sim = Simulation(wl, "mars", dataclasses.replace(SETUP, busy_cpus=1.5), _cfg("mars"))
    assert sim.proxy is not None
    assert sim.cpu.cpus == 0.5 and sim.proxy.plane.tool_cpus == 2
    sim.run()
    assert sim.proxy.plane.signals["w0"].tool_cpus == 2


def test_state_snapshots_show_the_core_without_changing_the_run() -> None:
    # The admission test's workload (12 sessions at once, 384 blocks): the snapshots must see
    # the queue that forms, name the sessions the core holds, and leave the run as it was.
    wl = _workload()
    plain = Simulation(wl, "mars", SETUP, _cfg("mars"))
    base = plain.run()
    assert plain.states == [] and base.extra["state_snapshots"] == 0
    sim = Simulation(wl, "mars", dataclasses.replace(SETUP, state_every_s=0.5), _cfg("mars"))
    res = sim.run()
    assert [o.end_s for o in res.outcomes] == [o.end_s for o in base.outcomes]
    rows = sim.states
    assert res.extra["state_snapshots"] == len(rows) >= 2
    times = [r["time"] for r in rows]
    assert times[0] == 0.0
    assert all(b - a >= 0.5 - 1e-9 for a, b in itertools.pairwise(times))
    assert max(r["admission"]["queue"]["length"] for r in rows) >= 6
    for r in rows:
        w = r["admission"]["workers"]["w0"]
        assert w["admitted"] == len(w["sessions"])
        assert set(w["sessions"]) <= {p.id for p in wl.sessions}
        assert 0.0 <= r["engines"]["w0"]["kv_usage"] <= 1.0
    # every session arrives at 0, so the queue only drains
    queue = [r["admission"]["queue"]["length"] for r in rows]
    assert queue == sorted(queue, reverse=True)


def test_a_tight_queue_deadline_refuses_sessions_and_the_figures_count_them() -> None:
    # The 12 sessions arrive at once on a cache for about 3; with 0.3 s of patience most are
    # refused, each counted from its arrival to its refusal (at the first control tick past
    # the deadline). Lifted, the same workload finishes every session.
    tight = options.proxy_config("mars", options.parse_sets(
        ["admission.tuning.aging_margin_s=0.05"], queue_deadline_s=0.3), ["http://w0"])
    assert tight.admission.queue_deadline_s == 0.3
    res = Simulation(_workload(), "mars", SETUP, tight).run()
    refused = [o for o in res.outcomes if o.status == "refused"]
    assert 0 < len(refused) < 12
    tick = tight.admission.tuning.control_interval_s
    for o in refused:
        assert o.turns[-1].status == 503 and o.error == "queue_deadline"
        assert o.stopped_s is not None and o.end_s is None
        assert 0.3 <= o.counted_s <= 0.3 + tick + 1e-9
    s = res.summary()
    assert (s.finished, s.rejected, s.failed) == (12 - len(refused), len(refused), 0)
    assert s.completion == pytest.approx(s.finished / 12)
    counted = [o.counted_s for o in res.outcomes]
    assert s.mean_s == pytest.approx(sum(counted) / 12)
    assert s.p95_s == pytest.approx(percentile(counted, 95))
    assert s.mean_finished_s == pytest.approx(
        sum(o.counted_s for o in res.outcomes if o.ok) / s.finished)
    lifted = Simulation(_workload(), "mars", SETUP, _cfg("mars")).run().summary()
    assert (lifted.finished, lifted.completion) == (12, 1.0)


def test_sessions_left_at_the_horizon_count_until_the_horizon() -> None:
    setup = dataclasses.replace(SETUP, horizon_s=0.5)
    res = Simulation(_workload(), "direct", setup, None).run()
    left = [o for o in res.outcomes if not o.ok]
    assert left and all(o.status == "failed" and o.stopped_s == 0.5 for o in left)
    assert all(o.counted_s == pytest.approx(0.5 - o.arrival_s) for o in left)
    assert res.summary().failed == len(left)
