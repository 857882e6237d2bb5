"""Parity: the gateway's shells and the simulator's driver make the same decisions.

A simulation records every input its driver feeds the control plane (requests, calls, tool
phases, ticks with what it observed of its engines, session ends) and the plane's decision log.
The same inputs then go through the gateway's shells (the in-memory window store, a virtual
clock, scripted probes): admission through ``Gateway.admit`` and the store's confirmation,
levels through the scheduler shell's ``prepare``, call ends through ``Gateway.call_ended``,
ticks through both shells' tick methods. The two decision logs (admissions, placements, levels,
retention, window levels, refusals, ends) must be equal, entry for entry.

With KV events (``SimSetup.kv_events``) the simulation's indexes also give resident prefixes
and resident blocks per session; the replay hands them over where the relay does: a new
session's prefix to ``Gateway.admit``, a call's resident tokens to ``SchedulerShell.prepare``,
the blocks per session in the observations the shells' ticks read.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from marsproxy.config import WorkerConfig
from marsproxy.core.session_record import EndReason
from marsproxy.emulator.profiles import get_profile
from marsproxy.gateway.http.sse import Usage
from marsproxy.gateway.shells.admission_types import Granted
from marsproxy.gateway.shells.scheduler import Prepared
from marsproxy.gateway.shells.service import Gateway
from marsproxy.policy.log import DecisionLog
from marsproxy.runs import options
from marsproxy.runs.arrivals import ArrivalSpec
from marsproxy.runs.mix import MixGroup, parse_mix
from marsproxy.runs.trace import load_trace
from marsproxy.runs.workload import WorkloadSpec, build_workload
from marsproxy.sim.harness import SimSetup, Simulation
from marsproxy.sim.proxy import TENANT, Input
from marsproxy.sim.sweep import make_case, swept_config


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _simulate(policy: str, workers: int, sessions: int, seed: int, sets: list[str],
              mode: str, blocks: int, groups: int = 0, trees: tuple[int, int] | None = None,
              mix: tuple[MixGroup, ...] = (), plain: bool = False,
              ) -> tuple[Any, list[Input], DecisionLog]:
    """``groups``: sessions in that many groups sharing a first prompt, with KV events;
    ``trees``: roots spawning that many children; ``mix``: groups by class or tenant;
    ``plain``: agents send no final flag and report no tool phases."""
    wl = build_workload(load_trace(), WorkloadSpec(
        sessions=sessions, seed=seed, token_scale=0.05, tool_time_scale=0.05, max_turns=4,
        max_context_tokens=3000, arrivals=ArrivalSpec("poisson", 2.0), prefix_groups=groups,
        prefix_tokens=400, trees=trees, mix=mix))
    urls = [f"http://127.0.0.1:{9 + i}" for i in range(workers)]
    cfg = options.proxy_config(policy, options.parse_sets(sets), urls)
    # The simulator names its workers w0, w1, ...: the gateway's labels must match.
    cfg = cfg.model_copy(update={"workers": [
        WorkerConfig(url=u, name=f"w{i}", priority=mode == "priority")
        for i, u in enumerate(urls)]})
    setup = SimSetup(profile=get_profile("tiny", num_blocks=blocks), workers=workers,
                     tool_cpus=2, system_prompt_tokens=60, worker_mode=mode,  # type: ignore[arg-type]
                     kv_events=groups > 0, send_final=not plain, report_tools=not plain)
    return _record(policy, cfg, wl, setup)


def _record(policy: str, cfg: Any, wl: Any, setup: SimSetup,
            ) -> tuple[Any, list[Input], DecisionLog]:
    """The simulation's inputs to the plane and its decision log."""
    log = DecisionLog()
    sim = Simulation(wl, policy, setup, cfg, log=log, record=True)
    res = sim.run()
    assert all(o.ok for o in res.outcomes)
    assert sim.proxy is not None and sim.proxy.inputs is not None
    return cfg, sim.proxy.inputs, log


async def _replay(cfg: Any, inputs: list[Input]) -> DecisionLog:
    clock, log = _Clock(), DecisionLog()
    gw = Gateway(cfg, clock=clock, log=log)
    tel = gw.telemetry
    tel.wall = clock  # type: ignore[method-assign]  # the tool clock: virtual too
    observed: dict[str, Any] = {}
    gw.observe = lambda: observed
    if gw.admission is not None:
        await gw.admission.store.start()
    url = {w.label: w.url for w in cfg.workers}
    admits: dict[str, asyncio.Task[Any]] = {}
    prepared: dict[str, asyncio.Task[Prepared]] = {}
    incarnations: dict[str, int | None] = {}  # each call's session, as the gateway granted it
    try:
        for inp in inputs:
            clock.t = inp.now
            a = inp.args
            if inp.kind == "request":
                admits[a["key"]] = asyncio.ensure_future(gw.admit(
                    a["key"], a.get("tenant", TENANT), 4 * a["tokens"], a["final"],
                    tokens=a["tokens"], cls=a.get("cls"), prefix=a["prefix"],
                    parent=a.get("parent")))
            elif inp.kind == "call_start":
                verdict = admits.pop(a["key"])
                assert verdict.done(), f"{a['key']} not admitted by the gateway at {inp.now}"
                v = verdict.result()
                assert isinstance(v, Granted) and v.worker == a["worker"], (inp, v)
                incarnations[a["key"]] = v.incarnation
                prepared[a["key"]] = asyncio.ensure_future(gw.scheduler.prepare(
                    a["key"], url[a["worker"]], {}, b"{}",
                    tokens=a["tokens"], resident_tokens=a["resident_tokens"]))  # gated: waits
            elif inp.kind == "call_end":
                call = prepared.pop(a["key"])
                assert call.done(), f"{a['key']}'s call not released by the gateway"
                gw.call_ended(a["key"], call.result(), ok=True, usage=Usage(
                    a["prompt_tokens"], a["completion_tokens"], a["cached_tokens"]),
                    engine_s=a["engine_s"], continues=a["continues"], admitted=True,
                    chars=4 * a["prompt_tokens"], reply=a["reply"],
                    incarnation=incarnations.pop(a["key"]))
            elif inp.kind == "tool":
                tracker = tel.tracker
                if a["kind"] == "response_ended":
                    tracker.response_ended(a["key"], inp.now)
                elif a["kind"] == "request_started":
                    tracker.request_started(a["key"], inp.now)
                else:
                    tracker.explicit_event(a["key"], a["kind"], a["tool"], inp.now, None)
            elif inp.kind == "tick":
                observed.update(a["observed"])
                tel.cpu.latest = a["cpu"]
                if gw.admission is not None:
                    await gw.admission.tick()
                else:
                    gw.tick_plane()
            elif inp.kind == "sched_tick":
                observed.update(a["observed"])
                gw.scheduler.tick()
            elif inp.kind == "release":  # a call held for a session due back goes
                gw.scheduler.release_now()
            elif inp.kind == "expire":  # a KV hold ends while sessions wait: the shell's timer
                assert gw.admission is not None
                gw.admission.expire_now()
            elif inp.kind == "session_end":
                gw.session_over(a["key"], EndReason(a["reason"]))
            for _ in range(4):  # what the shells spawned (store confirmations) runs now
                await asyncio.sleep(0)
    finally:
        if gw.admission is not None:
            await gw.admission.stop()
    return log


WINDOW = ["admission.window_max=4", "admission.window_init=4"]
CASES = [
    pytest.param("mars", 1, 14, 1, [], "priority", 256, id="mars-1-worker"),
    pytest.param("mars", 2, 16, 2, WINDOW, "priority", 256, id="mars-2-workers-window"),
    pytest.param("mars", 2, 14, 6, [], "gated", 256, id="mars-gated"),
    # KV-tight: sessions wait for the fit (a stale store count once read as another replica's)
    pytest.param("mars", 1, 16, 3, [], "gated", 160, id="mars-kv-tight-gated"),
    pytest.param("mars", 1, 16, 3, [], "priority", 128, id="mars-kv-tight"),
    pytest.param("mars-no-admission", 2, 12, 3, [], "priority", 256, id="admission-off"),
    pytest.param("fcfs", 2, 10, 4, [], "priority", 256, id="fcfs"),
    # KV events: prefix placement, the resident-block fit, retention verified and corrected.
    pytest.param("mars", 3, 18, 5, [], "priority", 160, 3, id="mars-kv-events"),
    pytest.param("mars", 2, 14, 7, [], "gated", 128, 2, id="mars-kv-events-gated"),
]


@pytest.mark.parametrize(("policy", "workers", "sessions", "seed", "sets", "mode", "blocks",
                          "groups"), [c if len(c.values) == 8 else pytest.param(
                              *c.values, 0, id=c.id) for c in CASES])
async def test_gateway_and_simulator_decide_alike(
    policy: str, workers: int, sessions: int, seed: int, sets: list[str], mode: str,
    blocks: int, groups: int,
) -> None:
    cfg, inputs, sim_log = _simulate(policy, workers, sessions, seed, sets, mode, blocks, groups)
    kinds = {e.kind for e in sim_log.entries}
    assert "admit" in kinds and "end" in kinds  # the run decided something worth comparing
    if policy == "mars":
        assert {"level", "retain"} <= kinds
    if groups:  # the KV facts were there and used
        assert any(i.args.get("prefix") for i in inputs)
        assert any(i.args.get("resident_tokens") for i in inputs)
        assert any(o.session_blocks for i in inputs if i.kind == "tick"
                   for o in i.args["observed"].values())
        assert "verified" in kinds
    gw_log = await _replay(cfg, inputs)
    for i, (s, g) in enumerate(zip(sim_log.entries, gw_log.entries, strict=False)):
        assert dataclasses.astuple(s) == dataclasses.astuple(g), f"entry {i}: sim {s} gw {g}"
    assert len(gw_log.entries) == len(sim_log.entries)


@pytest.mark.parametrize("mode", ["gated", "priority"])
async def test_plain_tool_calling_agents_decide_alike(mode: str) -> None:
    # No final flags, no tool events: sessions end on their answers (core/answers.py), the
    # tool phases are inferred from the gaps.
    cfg, inputs, sim_log = _simulate("mars", 2, 14, 8, [], mode, 192, plain=True)
    ends = [e.detail for e in sim_log.entries if e.kind == "end"]
    assert ("answered",) in ends and ("final",) not in ends
    gw_log = await _replay(cfg, inputs)
    assert [dataclasses.astuple(e) for e in gw_log.entries] == [
        dataclasses.astuple(e) for e in sim_log.entries]


async def test_holds_that_end_while_sessions_wait_decide_alike() -> None:
    # Sweep workload 412: bursts of 7 text agents (no final flag) every 20 s on 256 blocks; a
    # burst waits for the KV holds of the one before, which end at their time (the
    # simulator's "expire" event, the gateway's timer), not at the next tick.
    case = make_case(412, load_trace())
    cfg = swept_config([], ["http://127.0.0.1:9"])
    cfg = cfg.model_copy(update={"workers": [
        WorkerConfig(url="http://127.0.0.1:9", name="w0", priority=True)]})
    assert case.setup.workers == 1 and case.setup.worker_mode == "priority"
    cfg, inputs, sim_log = _record("mars", cfg, case.workload, case.setup)
    assert any(i.kind == "expire" for i in inputs)
    gw_log = await _replay(cfg, inputs)
    assert [dataclasses.astuple(e) for e in gw_log.entries] == [
        dataclasses.astuple(e) for e in sim_log.entries]


@pytest.mark.parametrize("mode", ["gated", "priority"])
async def test_agent_trees_decide_alike(mode: str) -> None:
    # Parents that spawn children in a tool phase: the children's lane,
    # the waiting parents' released holds and the inherited levels, the same through both.
    cfg, inputs, sim_log = _simulate("mars", 1, 16, 1, [], mode, 256, trees=(2, 4))
    kinds = {e.kind for e in sim_log.entries}
    assert {"child", "tree_wait", "admit", "level"} <= kinds
    gw_log = await _replay(cfg, inputs)
    for i, (s, g) in enumerate(zip(sim_log.entries, gw_log.entries, strict=False)):
        assert dataclasses.astuple(s) == dataclasses.astuple(g), f"entry {i}: sim {s} gw {g}"
    assert len(gw_log.entries) == len(sim_log.entries)


@pytest.mark.parametrize(("mode", "mix", "kind", "blocks", "held"), [
    ("priority", "interactive:4@1,batch:14@3", "class", 160, False),
    ("gated", "interactive:3@1,batch:12@3", "class", 160, False),
    ("priority", "light:4@1,heavy:14@3", "tenant", 160, False),
    # tighter: a batch call waits on the idle worker for an interactive session due back,
    # and goes when that wait ends (the simulator's "release", the gateway's timer)
    ("priority", "interactive:4@1,batch:12@3", "class", 128, True),
])
async def test_classes_and_tenants_decide_alike(mode: str, mix: str, kind: str, blocks: int,
                                                held: bool) -> None:
    # Classes (the first class's KV fit, a later class's calls gated behind it) and tenants'
    # turns, on a KV-tight worker: the same through both drivers.
    groups = parse_mix(mix, kind)  # type: ignore[arg-type]
    cfg, inputs, sim_log = _simulate("mars", 1, 1, 2, [], mode, blocks, mix=groups)
    assert {i.args.get("cls" if kind == "class" else "tenant") for i in inputs
            if i.kind == "request"} >= {g.name for g in groups}
    assert any(i.kind == "release" for i in inputs) is held
    gw_log = await _replay(cfg, inputs)
    for i, (s, g) in enumerate(zip(sim_log.entries, gw_log.entries, strict=False)):
        assert dataclasses.astuple(s) == dataclasses.astuple(g), f"entry {i}: sim {s} gw {g}"
    assert len(gw_log.entries) == len(sim_log.entries)
