"""One policy on one workload, in virtual time: agents, the proxy's core, engines and tool CPUs.

Drivers of the same pure code the gateway drives:
- admission: :class:`marsproxy.aimd.admission.AdmissionCore` (``on_request``,
  ``on_response_end``, ``tick`` every ``admission.control_interval_s``) with the policy preset's
  config, fed the engines' KV state and the tool tracker's CPU signals, as the gateway's probes
  would (sampled at each control tick);
- tool phases: :class:`marsproxy.probes.tool_phases.ToolPhaseTracker` (explicit tool events
  when the agent reports them, else inferred), for the backlog ratio and tool-time predictions;
- scheduling: :class:`marsproxy.sched.core.SchedulerCore`, fed as the gateway's
  ``SchedulerShell`` feeds it: ``arrive`` when an admitted call goes to its worker (then the
  call goes at once with its level as the engine priority, or waits in the core's dispatch gate
  on ``gated`` workers), ``end`` with the call's usage, ``tick`` every ``scheduler.tick_s`` with
  the worker's facts (KV usage, block counts, the prefill speed a scraper would compute), and
  ``session_ended``; the ledger's retained blocks go into the admission signals;
- engines: :class:`marsproxy.emulator.engine.Engine`, stepped back to back while it has work;
- tools: :class:`marsproxy.sim.cpu.ProcessorSharing` over ``tool_cpus - busy_cpus`` cores.

``direct`` has no proxy: each session goes straight to one worker (round robin), FCFS.

Agents replay sessions as the live benchmark does: append-only prompts (a shared system prompt,
then the session's own tokens, every reply included), ``max_tokens`` = the planned output with
``ignore_eos``, the final flag on the last call, a tool phase of the planned CPU seconds after
every call but the last. A rejected call (429/503) ends the session as refused, at the time
of the refusal; a session still running at ``horizon_s`` stops there, as failed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from marsproxy.aimd.admission import Actions, AdmissionCore, DecisionKind, WorkerSignals
from marsproxy.config import MarsConfig, ToolsConfig
from marsproxy.core.events import Event, PressureSample, event_to_dict
from marsproxy.core.kv import free_blocks_from_usage
from marsproxy.emulator.engine import Engine, FinishedEvent, Policy, RequestError, StepResult
from marsproxy.emulator.profiles import EngineProfile
from marsproxy.emulator.tokenizer import filler_token_id
from marsproxy.probes.cpu import CpuPressure
from marsproxy.probes.tool_signal import ToolCpuSignals, tool_plane
from marsproxy.runs.ideal import ideal_seconds
from marsproxy.runs.results import RunResult, SessionOutcome, TurnOutcome
from marsproxy.runs.timeline import timeline
from marsproxy.runs.workload import PlannedSession, Workload
from marsproxy.sched.core import SchedulerCore
from marsproxy.sched.tickets import Mode, WorkerFacts
from marsproxy.sim.cpu import ProcessorSharing
from marsproxy.sim.prefill import PrefillRate
from marsproxy.telemetry.admission_state import core_state

_TENANT = "bench"
_SYSTEM_BASE = 100  # token ids of the shared system prompt start here
_SESSION_BASE = 10_000_000  # each session's first own token: unique, so prefixes diverge
_FILL = 7  # the rest of a session's new tokens (the hash chain keeps them apart)
_TIMELINE_TYPES = frozenset(
    {"window_change", "pressure_sample", "session_queued", "session_admitted", "rejected",
     "session_end"}
)


@dataclass(frozen=True, slots=True)
class SimSetup:
    profile: EngineProfile
    workers: int = 1
    tool_cpus: float = 16.0
    busy_cpus: float = 0.0
    """Of the ``tool_cpus`` cores, those taken by other work on the tools' host (the engine's
    host process, the proxy, the agents): tools share ``tool_cpus - busy_cpus`` of them while
    the proxy counts ``tool_cpus``, as on a live host where they all run side by side."""
    system_prompt_tokens: int = 600
    worker_mode: Mode = "priority"
    """How workers order continuations (with a priority policy): ``priority`` — engines
    schedule by the body's ``priority`` (vLLM ``--scheduling-policy priority``); ``gated`` —
    FCFS engines, the scheduler core's dispatch gate releases continuations in level order."""
    report_tools: bool = True
    """Agents report tool_start/tool_end with the tool kind (else the tracker infers phases)."""
    send_final: bool = True
    """Agents flag their last call as final; else (a plain OpenAI client) the proxy holds each
    session until its idle timeout, and the run goes on until the last one has ended."""
    pressure_every: int = 5
    """A pressure_sample event every this many control ticks (the gateway: every 5th scrape)."""
    time_scale: float = 1.0
    """Seconds of the run per modelled engine second (as the emulator's --time-scale), so a
    simulation can mirror a live run on slowed-down emulated workers."""
    horizon_s: float = 1e7
    """Give up at this virtual time (a policy that deadlocks must not hang the run)."""
    call_overhead_s: float = 0.0
    """Seconds between a tool phase's end and the agent's next call reaching the proxy: what
    the agent, the HTTP stacks and the proxy spend per call outside the engine and the tools.
    The session holds its admission slot meanwhile. Zero by default; a live run on a busy
    2-core host spends some 10–15 ms (docs/benchmarks.md)."""
    state_every_s: float = 0.0
    """Keep a state snapshot (the admission core's part of ``/mars/v1/state`` and each
    engine's counts) at the first control tick this many virtual seconds after the last one,
    as ``bench live`` polls the proxy's state; 0: none."""


@dataclass(slots=True)
class _Agent:
    plan: PlannedSession
    seq: int
    outcome: SessionOutcome
    turn: int = 0
    worker: str | None = None
    context: int = 0  # tokens in KV after the previous call: its prompt and reply
    call: int | None = None  # the scheduler core's ticket of the call in the gate or running
    tokens: list[int] = field(default_factory=list)
    sent_s: float = 0.0
    first_token_s: float | None = None
    done: bool = False


class Simulation:
    def __init__(
        self, workload: Workload, policy: str, setup: SimSetup, cfg: MarsConfig | None,
        progress: Callable[[int], None] | None = None,
        on_tick: Callable[[float, AdmissionCore], None] | None = None,
    ) -> None:
        """``on_tick``: called after every admission control tick with the core (the sweep's
        invariant checks read its state there)."""
        self.workload = workload
        self.policy = policy
        self.setup = setup
        self.cfg = cfg
        self.workers = [f"w{i}" for i in range(setup.workers)]
        self.sched = self._scheduler(cfg, setup)
        engine_policy: Policy = "fcfs"
        if self.sched is not None and self.sched.enabled and setup.worker_mode == "priority":
            engine_policy = "priority"
        self.engines = {w: Engine(setup.profile, engine_policy) for w in self.workers}
        self.prefill = {w: PrefillRate() for w in self.workers}
        self.core = AdmissionCore(cfg.admission, self.workers) if cfg else None
        # Without a proxy (direct) the tracker only times the agents' tools: the defaults.
        self.tracker, self.tool_signal = tool_plane(cfg.tools if cfg else ToolsConfig(),
                                                    setup.tool_cpus)
        self.cpu = ProcessorSharing(setup.tool_cpus - setup.busy_cpus)
        self._progress = progress
        self._on_tick_hook = on_tick
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._busy = dict.fromkeys(self.workers, False)
        self._agents: dict[str, _Agent] = {}
        self._by_request: dict[str, _Agent] = {}
        self._held: dict[str, _Agent] = {}
        self._gated: dict[int, _Agent] = {}  # call → agent whose call waits in the dispatch gate
        self._cpu_version = 0
        self._unfinished = 0
        self._untold = 0  # agents gone without telling the proxy (their sessions time out)
        self._ticks = 0
        self.events: list[dict[str, Any]] = []
        self.states: list[dict[str, Any]] = []
        self._next_state_s = 0.0
        self.stats: dict[str, int] = {"retained": 0, "not_retained": 0, "preemptions": 0,
                                      "gate_waits": 0, "max_tools": 0}
        self._system = list(range(_SYSTEM_BASE, _SYSTEM_BASE + setup.system_prompt_tokens))
        self._reply: list[int] = []

    def _scheduler(self, cfg: MarsConfig | None, setup: SimSetup) -> SchedulerCore | None:
        """The scheduler core, as the gateway's shell builds it; None where the shell is passive
        (the fcfs preset: a plain session-affine proxy) or there is no proxy."""
        if cfg is None:
            return None
        s = cfg.scheduler
        if s.priority_policy == "off" and s.retention_policy == "off" and s.hint_encoder == "none":
            return None
        core = SchedulerCore(s, self.workers, cfg.admission.kv_reserve_frac)
        for w in self.workers:
            core.set_mode(w, setup.worker_mode)
        return core

    # -- the event loop ----------------------------------------------------------------------
    def _push(self, t: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def run(self) -> RunResult:
        prof = self.setup.profile
        for i, plan in enumerate(self.workload.sessions):
            llm, tool = ideal_seconds(plan, prof, self.setup.time_scale)
            agent = _Agent(plan, i, SessionOutcome(plan.id, plan.arrival_s, llm + tool,
                                                   len(plan.turns)))
            self._agents[plan.id] = agent
            self._push(plan.arrival_s, "arrive", agent)
        self._unfinished = len(self._agents)
        if self.core is not None:
            self._push(0.0, "tick")
        if self.sched is not None:
            self._push(0.0, "sched_tick")
        handlers: dict[str, Callable[[float, Any], None]] = {
            "arrive": self._on_arrive, "step": self._on_step_done, "cpu": self._on_cpu,
            "tick": self._on_tick, "sched_tick": self._on_sched_tick, "send": self._request,
        }
        now = 0.0
        while self._heap and self._live():
            now, _, kind, payload = heapq.heappop(self._heap)
            if now > self.setup.horizon_s:
                break
            handlers[kind](now, payload)
        for agent in self._agents.values():
            if not agent.done and not agent.outcome.error:
                agent.outcome.error = "unfinished at the simulation horizon"
                agent.outcome.stopped_s = min(now, self.setup.horizon_s)
        self.stats["preemptions"] = sum(e.num_preemptions for e in self.engines.values())
        return RunResult(
            policy=self.policy, regime="", load="",
            outcomes=[a.outcome for a in self._agents.values()],
            timeline=timeline(self.events, 0.0),
            extra={"stats": dict(self.stats), "sim_end_s": now,
                   "state_snapshots": len(self.states)},
        )

    def _live(self) -> bool:
        # Sessions whose agents left without telling the proxy (no final flag, or given up after
        # an upstream error) outlive them in the core until idle timeout. (Only those: after
        # final flags, a session the core still holds then is a leak to see.)
        return self._unfinished > 0 or (self._untold > 0 and self.core is not None
                                        and len(self.core.sessions) > 0)

    def leftovers(self) -> dict[str, int]:
        """What the run still holds outside the cores: agents waiting for admission or in the
        dispatch gate, calls in the engines, tool phases running."""
        return {"held_agents": len(self._held), "gated_calls": len(self._gated),
                "engine_calls": len(self._by_request),
                "engines_with_work": sum(e.has_work() for e in self.engines.values()),
                "tools_running": self.cpu.running}

    # -- agents ------------------------------------------------------------------------------
    def _on_arrive(self, now: float, agent: _Agent) -> None:
        self._request(now, agent)

    def _request(self, now: float, agent: _Agent) -> None:
        """The agent sends its next call (through the proxy, or straight to a worker)."""
        agent.sent_s = now
        prompt = agent.plan.turns[agent.turn].input_tokens
        final = self.setup.send_final and agent.turn == len(agent.plan.turns) - 1
        if self.core is None:
            self._dispatch(now, agent, self.workers[agent.seq % len(self.workers)])
            return
        if self.sched is not None:
            # As the gateway: the ledger as it is now, not as of the last control tick.
            for w in self.workers:
                self.core.set_retained(w, self.sched.retained_blocks(w))
        d = self.core.on_request(now, agent.plan.id, _TENANT, max(prompt, agent.context + 1),
                                 final=final)
        self._carry(now, d.actions)
        if d.kind is DecisionKind.ADMITTED and d.worker is not None:
            self._dispatch(now, agent, d.worker)
        elif d.kind is DecisionKind.WAIT:
            self._held[agent.plan.id] = agent
        else:
            self._fail(now, agent, d.status or 429, d.reason)

    def _prompt_tokens(self, agent: _Agent) -> list[int]:
        turn = agent.plan.turns[agent.turn]
        if not agent.tokens:
            agent.tokens = [*self._system, _SESSION_BASE + agent.seq]
        grow = max(1, turn.input_tokens - len(agent.tokens))
        agent.tokens.extend(itertools.repeat(_FILL, grow))
        return agent.tokens

    def _reply_ids(self, n: int) -> list[int]:
        while len(self._reply) < n:
            self._reply.append(filler_token_id(len(self._reply)))
        return self._reply[:n]

    def _dispatch(self, now: float, agent: _Agent, worker: str) -> None:
        if agent.worker is not None and agent.worker != worker:
            agent.context = 0  # moved: its prefix is on the other worker
        agent.worker = worker
        tokens = self._prompt_tokens(agent)
        if self.sched is None:
            self._send(now, agent, worker, 0)
            return
        sid = agent.plan.id
        t = self.sched.arrive(
            now, sid, worker, len(tokens),
            max_new_tokens=agent.plan.turns[agent.turn].output_tokens,
            predicted_tool_s=self.tracker.predicted_duration(sid),
        )
        agent.call = t.call
        if not t.gated:
            self._send(now, agent, worker, t.priority or 0)
            return
        self._gated[t.call] = agent
        self._release(now, [worker])
        if not t.dispatched:
            self.stats["gate_waits"] += 1

    def _release(self, now: float, workers: list[str] | None = None) -> None:
        """Send what the scheduler core's dispatch gate lets go now."""
        assert self.sched is not None
        for t in self.sched.release(now, workers):
            agent = self._gated.pop(t.call, None)
            if agent is not None:
                self._send(now, agent, t.worker, t.priority or 0)

    def _send(self, now: float, agent: _Agent, worker: str, priority: int) -> None:
        """The call reaches the worker's engine."""
        rid = f"{agent.plan.id}#{agent.turn}"
        turn = agent.plan.turns[agent.turn]
        try:
            self.engines[worker].add_request(rid, agent.tokens, turn.output_tokens,
                                             ignore_eos=True, priority=priority, now=now)
        except RequestError as exc:
            if self.sched is not None and agent.call is not None:
                self.sched.cancel(agent.call)
                agent.call = None
                self._release(now, [worker])
            self._fail(now, agent, 400, str(exc))
            return
        self._by_request[rid] = agent
        self._kick(worker, now)

    def _fail(self, now: float, agent: _Agent, status: int, reason: str) -> None:
        agent.outcome.turns.append(TurnOutcome(agent.sent_s, None, now - agent.sent_s, status))
        agent.outcome.error = reason
        agent.outcome.stopped_s = now
        # As the gateway: a refusal leaves nothing behind; an upstream error does not end the
        # session (a client may retry), so the agent that gives up leaves it to its idle timeout.
        self._finish(agent, told=status in (429, 503) or self.core is None)

    def _finish(self, agent: _Agent, *, told: bool = True) -> None:
        """``told``: the proxy learns that the session ended (else its idle timeout ends it)."""
        agent.done = True
        agent.tokens = []
        self._unfinished -= 1
        if told:
            self._forget(agent.plan.id)
        else:
            self._untold += 1
        if self._progress is not None:
            self._progress(1)

    def _forget(self, sid: str) -> None:
        self.tracker.session_ended(sid)
        if self.sched is not None:
            self.sched.session_ended(sid)

    def _call_done(self, now: float, fin: FinishedEvent) -> None:
        agent = self._by_request.pop(fin.req_id)
        sid = agent.plan.id
        agent.outcome.turns.append(TurnOutcome(
            sent_s=agent.sent_s,
            ttft_s=None if agent.first_token_s is None else agent.first_token_s - agent.sent_s,
            latency_s=now - agent.sent_s, status=200, prompt_tokens=fin.prompt_tokens,
            cached_tokens=fin.cached_tokens, completion_tokens=fin.completion_tokens))
        agent.first_token_s = None
        agent.tokens.extend(self._reply_ids(fin.completion_tokens))
        agent.context = fin.prompt_tokens + fin.completion_tokens
        last = agent.turn == len(agent.plan.turns) - 1
        final = last and self.setup.send_final
        # As the gateway: the scheduler hears the end of the call first (its retention
        # decision), then admission (which may end the session on its final call).
        if self.sched is not None and agent.call is not None:
            res = self.sched.end(
                now, agent.call, ok=True, prompt_tokens=fin.prompt_tokens,
                completion_tokens=fin.completion_tokens, cached_tokens=fin.cached_tokens,
                engine_s=fin.e2e_latency * self.setup.time_scale,
                predicted_tool_s=self.tracker.predicted_duration(sid), session_continues=not final,
            )
            agent.call = None
            if res.retention is not None and self.sched.cfg.retention_policy != "off":
                self.stats["retained" if res.retention.retain else "not_retained"] += 1
            if res.ticket is not None:
                self._release(now, [res.ticket.worker])
        if self.core is not None:
            self._carry(now, self.core.on_response_end(
                now, sid, prompt_chars=4 * fin.prompt_tokens, prompt_tokens=fin.prompt_tokens,
                usual_tool_s=self.tracker.predicted_duration(sid),
                completion_tokens=fin.completion_tokens))
        if agent.worker is not None:
            self.prefill[agent.worker].observe(fin.prompt_tokens - fin.cached_tokens,
                                               fin.prefill_time * self.setup.time_scale)
        if last:
            agent.outcome.end_s = now
            if not final and not self.setup.report_tools:
                self.tracker.response_ended(sid, now)  # to the proxy, a gap like any other
            self._finish(agent, told=final or self.core is None)
            return
        turn = agent.plan.turns[agent.turn]
        if self.setup.report_tools:
            self.tracker.explicit_event(sid, "tool_start", turn.tool, now, None)
        else:
            self.tracker.response_ended(sid, now)
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
            agent = self._agents[sid]
            if self.setup.report_tools:
                self.tracker.explicit_event(sid, "tool_end", agent.plan.turns[agent.turn].tool,
                                            now, None)
            else:
                self.tracker.request_started(sid, now)
            agent.turn += 1
            if self.setup.call_overhead_s > 0:
                self._push(now + self.setup.call_overhead_s, "send", agent)
            else:
                self._request(now, agent)
        self._schedule_cpu()

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
        for rid in result.first_token:
            self._by_request[rid].first_token_s = now
        for fin in result.finished:
            self._call_done(now, fin)
        self._kick(worker, now)

    # -- the proxy's control loop ------------------------------------------------------------
    def _signals(self, w: str, tools: ToolCpuSignals, now: float | None = None) -> WorkerSignals:
        eng = self.engines[w]
        prof = self.setup.profile
        usage = eng.kv.usage
        retained = self.sched.retained_blocks(w) if self.sched else 0
        return WorkerSignals(
            running=eng.stats().running, preemptions_total=float(eng.num_preemptions),
            sampled_at=now,
            prefill_tokens_per_s=self.prefill[w].sample(),
            kv_usage=usage, free_blocks=free_blocks_from_usage(usage, prof.num_blocks),
            total_blocks=prof.num_blocks, block_size=prof.block_size, retained_blocks=retained,
            tools_in_flight=tools.tools_in_flight, backlog_ratio=tools.backlog_ratio,
            tool_wait_ema_s=tools.tool_wait_ema_s, psi_some_avg10=tools.psi_some_avg10,
            tool_cpus=self.setup.tool_cpus,
        )

    def _cpu_reading(self, now: float) -> CpuPressure:
        # The tools' host as its PSI would show it: some task waits for a core while more
        # tools run than there are cores for them.
        contended = self.cpu.running > self.cpu.cpus
        return CpuPressure(sampled_at=now, source="sim",
                           psi_some_avg10=100.0 if contended else 0.0,
                           tool_cpus=self.setup.tool_cpus)

    def _on_tick(self, now: float, _: Any) -> None:
        assert self.core is not None and self.cfg is not None
        self.tool_signal.observe(self._cpu_reading(now))
        tools = self.tool_signal.signals(self.tracker, now)
        signals = {w: self._signals(w, tools, now) for w in self.workers}
        self._carry(now, self.core.tick(now, signals))
        if self._on_tick_hook is not None:
            self._on_tick_hook(now, self.core)
        self._ticks += 1
        if self.setup.state_every_s > 0 and now >= self._next_state_s:
            self._snapshot(now)
        if self._ticks % self.setup.pressure_every == 0:
            for w, s in signals.items():
                eng = self.engines[w].stats()
                self._record(PressureSample(
                    ts=now, worker=w, kv_usage=s.kv_usage, running=eng.running,
                    waiting=eng.waiting, tools_in_flight=s.tools_in_flight,
                    backlog_ratio=s.backlog_ratio))
        if self._live():
            self._push(now + self.cfg.admission.tuning.control_interval_s, "tick")

    def _snapshot(self, now: float) -> None:
        assert self.core is not None
        engines = {}
        for w, eng in self.engines.items():
            st = eng.stats()
            engines[w] = {"running": st.running, "waiting": st.waiting,
                          "kv_usage": eng.kv.usage, "preemptions_total": eng.num_preemptions}
        self.states.append({"time": now, "admission": core_state(self.core, now),
                            "engines": engines})
        self._next_state_s = now + self.setup.state_every_s

    def _on_sched_tick(self, now: float, _: Any) -> None:
        """The scheduler shell's tick: fresh worker facts, expiries and drops, then releases."""
        assert self.sched is not None
        prof = self.setup.profile
        for w in self.workers:
            self.sched.set_facts(w, WorkerFacts(
                max_num_seqs=prof.max_num_seqs, total_blocks=prof.num_blocks,
                block_size=prof.block_size, prefill_tokens_per_s=self.prefill[w].sample(),
                kv_usage=self.engines[w].kv.usage,
            ))
        self.sched.tick(now)
        self._release(now)
        if self._live():
            self._push(now + self.sched.cfg.tuning.tick_s, "sched_tick")

    def _record(self, ev: Event) -> None:
        if ev.type in _TIMELINE_TYPES:
            self.events.append(event_to_dict(ev))

    def _carry(self, now: float, actions: Actions) -> None:
        for ev in actions.events:
            self._record(ev)
        for a in actions.admitted:
            agent = self._held.pop(a.entry.session, None)
            if agent is not None:
                self._dispatch(now, agent, a.worker)
        for exp in actions.expired:
            agent = self._held.pop(exp.session, None)
            if agent is not None:
                self._fail(now, agent, exp.status, exp.reason)
        for sid, _ in actions.ended:
            ended = self._agents.get(sid)
            if ended is not None and ended.done:
                self._forget(sid)  # a session its agent left without a final flag
