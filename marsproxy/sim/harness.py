"""One policy on one workload, in virtual time: agents, the proxy's core, engines and tool CPUs.

Drives the pure code the gateway drives through :class:`marsproxy.sim.proxy.SimProxy` (the
control plane, fed the engines' state as the gateway's probes feed it, its ticks and timers as
events); engines: :class:`~marsproxy.emulator.engine.Engine`, stepped back to back while they
have work; tools: :class:`~marsproxy.sim.cpu.ProcessorSharing` over ``tool_cpus - busy_cpus``
cores; agent trees: :class:`~marsproxy.sim.trees.TreeRunner`. ``direct``: no proxy, each
session straight to one worker (round robin), FCFS.

Agents replay sessions as the live benchmark does (prompts: :mod:`marsproxy.sim.agents`; their
tenant and class: the plan's), the final flag on the last call, a tool phase after every call
but the last. A refused call ends the session then; one running at ``horizon_s`` fails there.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

from marsproxy.aimd.admission import AdmissionCore, DecisionKind
from marsproxy.config import MarsConfig
from marsproxy.core.session_record import EndReason
from marsproxy.emulator.engine import Engine, FinishedEvent, Policy, RequestError, StepResult
from marsproxy.policy.log import DecisionLog
from marsproxy.policy.plane import Outcome
from marsproxy.runs.results import RunResult, TurnOutcome
from marsproxy.runs.timeline import timeline
from marsproxy.runs.workload import Workload
from marsproxy.sched.core import SchedulerCore
from marsproxy.sched.tickets import Ticket
from marsproxy.sim.agents import Agent, Prompts, agents_for, mark_unfinished
from marsproxy.sim.cpu import ProcessorSharing
from marsproxy.sim.proxy import TENANT, SimProxy
from marsproxy.sim.setup import SimSetup
from marsproxy.sim.trees import TreeRunner

__all__ = ["SimSetup", "Simulation"]


class Simulation:
    def __init__(
        self, workload: Workload, policy: str, setup: SimSetup, cfg: MarsConfig | None,
        progress: Callable[[int], None] | None = None,
        on_tick: Callable[[float, AdmissionCore], None] | None = None,
        log: DecisionLog | None = None, record: bool = False,
    ) -> None:
        """``on_tick``: called with the core after every admission tick (the sweep's checks);
        ``log``, ``record``: the decision log and the recorded inputs (the parity test)."""
        self.workload = workload
        self.policy = policy
        self.setup = setup
        self.cfg = cfg
        self.workers = [f"w{i}" for i in range(setup.workers)]
        self.cpu = ProcessorSharing(setup.tool_cpus - setup.busy_cpus)
        self.engines: dict[str, Engine] = {}
        # Without a proxy (direct) each session goes straight to its worker.
        self.proxy = (None if cfg is None else
                      SimProxy(cfg, self.workers, setup, self.engines, self.cpu, log=log,
                               record=record))
        engine_policy: Policy = "fcfs"
        if self.sched is not None and self.sched.enabled and setup.worker_mode == "priority":
            engine_policy = "priority"
        self.engines.update({w: Engine(setup.profile, engine_policy) for w in self.workers})
        self._progress = progress
        self._on_tick_hook = on_tick
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._busy = dict.fromkeys(self.workers, False)
        self._agents: dict[str, Agent] = {}
        self._by_request: dict[str, Agent] = {}
        self._held: dict[str, Agent] = {}
        self._gated: dict[int, Agent] = {}  # call → agent whose call waits in the dispatch gate
        self._tickets: dict[int, Ticket] = {}
        self._release_at: float | None = None  # a "release" event is due then
        self._cpu_version = 0
        self._unfinished = 0
        self._untold = 0  # agents gone without telling the proxy (their sessions time out)
        self.stats: dict[str, int] = {"retained": 0, "not_retained": 0, "preemptions": 0,
                                      "gate_waits": 0, "max_tools": 0}
        self.prompts = Prompts(setup.system_prompt_tokens)
        self.trees = TreeRunner(self._agents)  # children start when their parent spawns them

    @property
    def core(self) -> AdmissionCore | None:
        return None if self.proxy is None else self.proxy.plane.admission

    @property
    def sched(self) -> SchedulerCore | None:
        """The scheduler core; None without a proxy or anything to schedule (fcfs preset)."""
        if self.proxy is None or self.proxy.plane.passive:
            return None
        return self.proxy.plane.scheduler

    @property
    def states(self) -> list[dict[str, Any]]:
        return [] if self.proxy is None else self.proxy.states

    # -- the event loop ----------------------------------------------------------------------
    def _push(self, t: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def run(self) -> RunResult:
        self._agents.update(agents_for(self.workload, self.setup.profile, self.setup.time_scale))
        for agent in self._agents.values():
            if agent.plan.parent is None:  # children arrive when their parent spawns them
                self._push(agent.plan.arrival_s, "arrive", agent)
        self._unfinished = len(self._agents)
        if self.proxy is not None:
            self._push(0.0, "tick")
        if self.sched is not None:
            self._push(0.0, "sched_tick")
        handlers: dict[str, Callable[[float, Any], None]] = {
            "arrive": self._request, "step": self._on_step_done, "cpu": self._on_cpu,
            "tick": self._on_tick, "sched_tick": self._on_sched_tick, "send": self._request,
            "release": self._on_release, "expire": self._on_expire,
        }
        now = 0.0
        while self._heap and self._live():
            now, _, kind, payload = heapq.heappop(self._heap)
            if now > self.setup.horizon_s:
                break
            handlers[kind](now, payload)
            if self.proxy is not None and (at := self.proxy.expire_due()) is not None:
                self._push(max(at, now), "expire")
        mark_unfinished(self._agents, min(now, self.setup.horizon_s))
        self.stats["preemptions"] = sum(e.num_preemptions for e in self.engines.values())
        return RunResult(
            policy=self.policy, regime="", load="",
            outcomes=[a.outcome for a in self._agents.values()],
            timeline=timeline([] if self.proxy is None else self.proxy.events, 0.0),
            extra={"stats": dict(self.stats), "sim_end_s": now,
                   "state_snapshots": len(self.states)},
        )

    def _live(self) -> bool:
        # Agents gone untold (no final flag, given up after an error) leave sessions in the
        # core until their idle timeout: only those (anything else left is a leak to see).
        return self._unfinished > 0 or (self._untold > 0 and self.core is not None
                                        and len(self.core.sessions) > 0)

    def leftovers(self) -> dict[str, int]:
        """What the run holds outside the cores: waiting agents, gated calls, engines, tools."""
        return {"held_agents": len(self._held), "gated_calls": len(self._gated),
                "engine_calls": len(self._by_request),
                "engines_with_work": sum(e.has_work() for e in self.engines.values()),
                "tools_running": self.cpu.running}

    # -- agents ------------------------------------------------------------------------------
    def _request(self, now: float, agent: Agent) -> None:
        """The agent sends its next call (through the proxy, or straight to a worker)."""
        agent.sent_s = now
        prompt = agent.plan.turns[agent.turn].input_tokens
        final = self.setup.send_final and agent.turn == len(agent.plan.turns) - 1
        if self.proxy is None:
            self._dispatch(now, agent, self.workers[agent.seq % len(self.workers)])
            return
        sid = agent.plan.id
        if self.proxy.plane.wants_tick(sid):  # as the gateway: the engines are seen at once
            self._carry(now, self.proxy.tick(now))
        ans = self.proxy.request(now, sid, max(prompt, agent.context + 1), final,
                                 lambda: self.prompts.next(agent), agent.plan.parent,
                                 agent.plan.tenant or TENANT, agent.plan.cls)
        agent.incarnation = ans.incarnation  # its call's end is charged to this session
        if ans.kind is DecisionKind.REJECT:
            self._carry(now, ans.outcome)
            self._fail(now, agent, ans.status or 429, ans.reason)
            return
        go_now = ans.kind is DecisionKind.ADMITTED and sid not in ans.outcome.proposed
        if not go_now:
            self._held[sid] = agent  # waits for admission (or for the store's confirmation)
        self._carry(now, ans.outcome)
        if go_now and ans.worker is not None:
            self._dispatch(now, agent, ans.worker)

    def _dispatch(self, now: float, agent: Agent, worker: str) -> None:
        if agent.worker is not None and agent.worker != worker:
            agent.context = 0  # moved: its prefix is on the other worker
        agent.worker = worker
        tokens = self.prompts.next(agent)
        proxy = self.proxy
        t = None if proxy is None else proxy.call_start(now, agent.plan.id, worker, tokens)
        if t is None:
            self._send(now, agent, worker, 0)
            return
        agent.call = t.call
        self._tickets[t.call] = t
        if not t.gated:
            self._send(now, agent, worker, t.priority or 0)
            return
        self._gated[t.call] = agent
        assert self.proxy is not None
        self._send_released(now, self.proxy.plane.release(now, [worker]))  # what the gate lets go
        if not t.dispatched:
            self.stats["gate_waits"] += 1

    def _send_released(self, now: float, released: list[Ticket]) -> None:
        for t in released:
            agent = self._gated.pop(t.call, None)
            if agent is not None:
                self._send(now, agent, t.worker, t.priority or 0)
        # A call held for a session due back goes when that wait ends (as the gateway's timer).
        at = None if self.sched is None else self.sched.next_release_at()
        if at is not None and (self._release_at is None or at < self._release_at):
            self._release_at = at
            self._push(at, "release")

    def _on_release(self, now: float, _: Any) -> None:
        assert self.proxy is not None
        if self._release_at is not None and now >= self._release_at:
            self._release_at = None
        self._send_released(now, self.proxy.release(now))

    def _on_expire(self, now: float, _: Any) -> None:
        if self.proxy is not None and (out := self.proxy.expire(now)) is not None:
            self._carry(now, out)

    def _send(self, now: float, agent: Agent, worker: str, priority: int) -> None:
        """The call reaches the worker's engine."""
        rid = f"{agent.plan.id}#{agent.turn}"
        turn = agent.plan.turns[agent.turn]
        try:
            self.engines[worker].add_request(rid, agent.tokens, turn.output_tokens, ignore_eos=True,
                                             priority=priority, now=now, session_id=agent.plan.id)
        except RequestError as exc:
            t = None if agent.call is None else self._tickets.pop(agent.call, None)
            if self.proxy is not None and t is not None:
                agent.call = None
                self._send_released(now, self.proxy.cancel(now, t))
            self._fail(now, agent, 400, str(exc))
            return
        self._by_request[rid] = agent
        self._kick(worker, now)

    def _fail(self, now: float, agent: Agent, status: int, reason: str) -> None:
        agent.outcome.turns.append(TurnOutcome(agent.sent_s, None, now - agent.sent_s, status))
        agent.outcome.error, agent.outcome.stopped_s = reason, now
        # As the gateway: a refusal leaves nothing; after an upstream error (a client may retry)
        # the agent that gives up leaves its session to the idle timeout.
        told = status in (429, 503) or self.proxy is None
        self._finish(now, agent, told=told, reason=EndReason.ABANDONED)

    def _finish(self, now: float, agent: Agent, *, told: bool = True,
                reason: EndReason = EndReason.FINAL) -> None:
        """``told``: the proxy hears the session end (else its idle timeout ends it)."""
        agent.done, agent.tokens = True, []
        self._unfinished -= 1
        if told:
            self._forget(now, agent.plan.id, reason)
        else:
            self._untold += 1
        if self._progress is not None:
            self._progress(1)
        parent = self.trees.done(agent)
        if parent is not None:  # its last child is done: the parent's next call goes
            self._resume(now, parent)

    def _forget(self, now: float, sid: str, reason: EndReason) -> None:
        if self.proxy is not None:
            self._carry(now, self.proxy.session_end(now, sid, reason))

    def _call_done(self, now: float, fin: FinishedEvent) -> None:
        agent = self._by_request.pop(fin.req_id)
        sid = agent.plan.id
        agent.outcome.turns.append(TurnOutcome(
            sent_s=agent.sent_s,
            ttft_s=None if agent.first_token_s is None else agent.first_token_s - agent.sent_s,
            latency_s=now - agent.sent_s, status=200, prompt_tokens=fin.prompt_tokens,
            cached_tokens=fin.cached_tokens, completion_tokens=fin.completion_tokens))
        agent.first_token_s = None
        agent.tokens.extend(self.prompts.reply(fin.completion_tokens))
        agent.context = fin.prompt_tokens + fin.completion_tokens
        last = agent.turn == len(agent.plan.turns) - 1
        final, answered = last and self.setup.send_final, False
        if self.proxy is not None:
            t = None if agent.call is None else self._tickets.pop(agent.call, None)
            agent.call = None
            end = self.proxy.call_end(
                now, sid, t, prompt_tokens=fin.prompt_tokens,
                completion_tokens=fin.completion_tokens, cached_tokens=fin.cached_tokens,
                engine_s=fin.e2e_latency * self.setup.time_scale, continues=not final,
                last=last, incarnation=agent.incarnation)
            answered, res = end.answered, end.result
            if res is not None and res.retention is not None and not self.proxy.plane.passive \
                    and self.proxy.cfg.scheduler.retention_policy != "off":
                self.stats["retained" if res.retention.retain else "not_retained"] += 1
            self._send_released(now, end.released)
            self._carry(now, end.outcome)
        if agent.worker is not None and self.proxy is not None:
            self.proxy.prefill[agent.worker].observe(fin.prompt_tokens - fin.cached_tokens,
                                                     fin.prefill_time * self.setup.time_scale)
        if last:
            agent.outcome.end_s = now
            told = final or answered or self.proxy is None
            if not told and not self.setup.report_tools and self.proxy is not None:
                self.proxy.tool(now, sid, "response_ended")  # to the proxy, a gap like any other
            self._finish(now, agent, told=told)
            return
        turn = agent.plan.turns[agent.turn]
        if self.proxy is not None:
            if self.setup.report_tools:
                self.proxy.tool(now, sid, "tool_start", turn.tool)
            else:
                self.proxy.tool(now, sid, "response_ended")
        kids = self.trees.spawn(agent, now)  # sub-agents: this tool phase is their run
        for child in kids:
            self._push(now, "arrive", child)
        if kids:
            return
        self.cpu.add(now, sid, turn.tool_s or 0.0)
        self.stats["max_tools"] = max(self.stats["max_tools"], self.cpu.running)
        self._schedule_cpu()

    # -- tools -------------------------------------------------------------------------------
    def _schedule_cpu(self) -> None:
        self._cpu_version += 1
        t = self.cpu.next_completion()
        if t is not None:
            self._push(t, "cpu", self._cpu_version)

    def _on_cpu(self, now: float, version: int) -> None:
        if version != self._cpu_version:
            return  # superseded by a later start or end
        for sid in self.cpu.pop_done(now):
            self._resume(now, self._agents[sid])
        self._schedule_cpu()

    def _resume(self, now: float, agent: Agent) -> None:
        """The agent's tool phase is over: its next call goes."""
        if self.proxy is not None:
            sid, tool = agent.plan.id, agent.plan.turns[agent.turn].tool
            if self.setup.report_tools:
                self.proxy.tool(now, sid, "tool_end", tool)
            else:
                self.proxy.tool(now, sid, "request_started")
        agent.turn += 1
        if self.setup.call_overhead_s > 0:
            self._push(now + self.setup.call_overhead_s, "send", agent)
        else:
            self._request(now, agent)

    # -- engines -----------------------------------------------------------------------------
    def _kick(self, worker: str, now: float) -> None:
        if self._busy[worker]:
            return
        eng = self.engines[worker]
        if not eng.has_work():
            return
        result = eng.step(now)
        if result.batch.num_tokens == 0:
            return  # nothing schedulable; a finish or a new request kicks it again
        self._busy[worker] = True
        self._push(now + result.duration * self.setup.time_scale, "step", (worker, result))

    def _on_step_done(self, now: float, payload: tuple[str, StepResult]) -> None:
        worker, result = payload
        self._busy[worker] = False
        if self.proxy is not None and self.proxy.kv is not None:  # its KV events are out
            self.proxy.kv.step_done(worker, now)
        for rid in result.first_token:
            self._by_request[rid].first_token_s = now
        for fin in result.finished:
            self._call_done(now, fin)
        self._kick(worker, now)

    # -- the proxy's control loops -------------------------------------------------------------
    def _on_tick(self, now: float, _: Any) -> None:
        assert self.proxy is not None and self.cfg is not None
        self._carry(now, self.proxy.tick(now))
        if self._on_tick_hook is not None:
            self._on_tick_hook(now, self.proxy.plane.admission)
        self.proxy.sample(now)
        if self._live():
            self._push(now + self.cfg.admission.tuning.control_interval_s, "tick")

    def _on_sched_tick(self, now: float, _: Any) -> None:
        """The scheduler shell's tick: fresh worker facts, expiries and drops, then releases."""
        assert self.proxy is not None
        self._send_released(now, self.proxy.sched_tick(now))
        if self._live():
            self._push(now + self.proxy.plane.scheduler.cfg.tuning.tick_s, "sched_tick")

    def _carry(self, now: float, out: Outcome) -> None:
        assert self.proxy is not None
        for ev in out.events:
            self.proxy.record(ev)
        go = [(self._held.pop(sid, None), self.proxy.confirm(now, sid)) for sid in out.proposed]
        for agent, worker in go:  # all confirmed first, as the gateway's store pass does
            if agent is not None and worker is not None:
                self._dispatch(now, agent, worker)
        for exp in out.expired:
            agent = self._held.pop(exp.session, None)
            if agent is not None:
                self._fail(now, agent, exp.status, exp.reason)
        for end in out.ended:
            ended = self._agents.get(end.session)
            if ended is not None and ended.done:
                self._forget(now, end.session, end.reason)  # an agent gone without a final flag
