"""The simulator's driver of the control plane: the proxy as the simulated agents see it.

Every decision comes from :class:`marsproxy.policy.plane.ControlPlane`, the same object the
gateway's shells drive; this module only feeds it what the simulation observes (each engine's
KV and running counts, the prefill speed a scraper would compute, the tools' host as its PSI
would read) and stands in for the window store of one replica: a proposed admission is
confirmed at once, as the in-memory store confirms it.

Every input it feeds the plane can be recorded (``inputs``): the parity test replays them
through the gateway's shells and compares the two decision logs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from marsproxy.config import MarsConfig
from marsproxy.core.answers import ReplyKind
from marsproxy.core.events import Event, PressureSample, event_to_dict
from marsproxy.core.session_record import EndReason
from marsproxy.emulator.engine import Engine
from marsproxy.policy.log import DecisionLog
from marsproxy.policy.observe import WorkerObservation
from marsproxy.policy.plane import Answer, CallEnd, ControlPlane, Outcome, Phase
from marsproxy.probes.cpu import CpuPressure
from marsproxy.sched.tickets import Ticket
from marsproxy.sim.cpu import ProcessorSharing
from marsproxy.sim.kv_view import KVView
from marsproxy.sim.prefill import PrefillRate
from marsproxy.sim.setup import SimSetup
from marsproxy.telemetry.admission_state import core_state

TENANT = "bench"
_TIMELINE_TYPES = frozenset(
    {"window_change", "pressure_sample", "session_queued", "session_admitted", "rejected",
     "session_end"}
)


@dataclass(slots=True)
class Input:
    """One input to the plane, as the parity test replays it."""

    kind: str
    now: float
    args: dict[str, Any] = field(default_factory=dict)


class SimProxy:
    def __init__(
        self, cfg: MarsConfig, workers: list[str], setup: SimSetup,
        engines: Mapping[str, Engine], cpu: ProcessorSharing, *,
        log: DecisionLog | None = None, record: bool = False,
    ) -> None:
        self.cfg, self.setup, self.engines, self.cpu = cfg, setup, engines, cpu
        self.workers = workers
        self.plane = ControlPlane(cfg, workers, tool_cpus=setup.tool_cpus, log=log)
        for w in workers:
            self.plane.scheduler.set_mode(w, setup.worker_mode)
        self.prefill = {w: PrefillRate() for w in workers}
        self.inputs: list[Input] | None = [] if record else None
        self.events: list[dict[str, Any]] = []
        self.states: list[dict[str, Any]] = []
        self._next_state_s = 0.0
        self._ticks = 0
        self._expire_at: float | None = None  # an "expire" event goes then
        self.kv = KVView(engines) if setup.kv_events else None

    def _in(self, name: str, now: float, **args: Any) -> None:
        if self.inputs is not None:
            self.inputs.append(Input(name, now, args))

    # -- what the agents do -----------------------------------------------------------------
    def request(self, now: float, key: str, tokens: int, final: bool,
                ids: Callable[[], Sequence[int]], parent: str | None = None,
                tenant: str = TENANT, cls: str | None = None) -> Answer:
        """``ids``: the prompt's token ids (asked only for a new session's first prompt, with
        KV events: its resident prefix per worker); ``parent``: the session that spawned it;
        ``tenant``, ``cls``: its tenant and service class (mixed workloads)."""
        prefix = None
        if self.kv is not None and self.plane.phase(key) is Phase.ENDED:
            prefix = self.kv.prefix(ids())
        self._in("request", now, key=key, tokens=tokens, final=final, prefix=prefix,
                 parent=parent, tenant=tenant, cls=cls)
        return self.plane.request(now, key, tenant, tokens=tokens, final=final, prefix=prefix,
                                  parent=parent, cls=cls)

    def call_start(self, now: float, key: str, worker: str, ids: Sequence[int]) -> Ticket | None:
        """``ids``: the call's prompt (with KV events: its prefix resident on ``worker``). No
        ``max_tokens``, as most clients send none (a reply's length is no client's to know)."""
        resident = None if self.kv is None else self.kv.resident(worker, ids)
        self._in("call_start", now, key=key, worker=worker, tokens=len(ids),
                 resident_tokens=resident)
        return self.plane.call_start(now, key, worker, tokens=len(ids), resident_tokens=resident)

    def call_end(self, now: float, key: str, ticket: Ticket | None, *, prompt_tokens: int,
                 completion_tokens: int, cached_tokens: int, engine_s: float,
                 continues: bool, last: bool = False, incarnation: int | None) -> CallEnd:
        """``last``: the session's last call. Agents acting through tool calls
        (``SimSetup.tool_calls``) answer there and call a tool everywhere else, and the plane
        hears the reply's kind as the gateway reads it (``CallEnd.answered``: it ended the
        session on the answer). ``incarnation``: the session its request joined
        (``Answer.incarnation``)."""
        reply = None if not self.setup.tool_calls else (
            ReplyKind.ANSWER if last else ReplyKind.TOOL_CALL)
        self._in("call_end", now, key=key, prompt_tokens=prompt_tokens,
                 completion_tokens=completion_tokens, cached_tokens=cached_tokens,
                 engine_s=engine_s, continues=continues, reply=reply)
        return self.plane.call_end(
            now, key, ticket, incarnation=incarnation, ok=True, admitted=True,
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            cached_tokens=cached_tokens, chars=4 * prompt_tokens, engine_s=engine_s,
            continues=continues, reply=reply)

    def cancel(self, now: float, ticket: Ticket) -> list[Ticket]:
        return self.plane.cancel(now, ticket)

    def tool(self, at: float, key: str, kind: str, tool: str = "") -> None:
        """A tool phase starts or ends: reported by the agent (``tool_start``/``tool_end``)
        or inferred from the calls (``response_ended``/``request_started``)."""
        self._in("tool", at, key=key, kind=kind, tool=tool)
        tracker = self.plane.tracker
        if kind == "response_ended":
            tracker.response_ended(key, at)
        elif kind == "request_started":
            tracker.request_started(key, at)
        else:
            tracker.explicit_event(key, kind, tool, at, None)

    def session_end(self, now: float, key: str, reason: EndReason) -> Outcome:
        self._in("session_end", now, key=key, reason=str(reason))
        return self.plane.session_end(now, key, reason)

    def confirm(self, now: float, key: str) -> str | None:
        """The store of one replica: a proposed session is confirmed at once."""
        p = self.plane.confirm(now, key)
        return None if p is None else p.worker

    # -- the control loops ----------------------------------------------------------------
    def observe(self, now: float) -> dict[str, WorkerObservation]:
        """Each engine as the gateway's scraper would see it now."""
        prof = self.setup.profile
        return {w: WorkerObservation(
            healthy=True, stale=False, kv_usage=eng.kv.usage, total_blocks=prof.num_blocks,
            block_size=prof.block_size, running=eng.stats().running,
            preemptions_total=float(eng.num_preemptions),
            prefill_tokens_per_s=self.prefill[w].sample(), sampled_at=now,
            max_num_seqs=prof.max_num_seqs, max_model_len=prof.effective_max_model_len,
            session_blocks=None if self.kv is None else self.kv.session_blocks(w),
        ) for w, eng in self.engines.items()}

    def cpu_reading(self, now: float) -> CpuPressure:
        # The tools' host as its PSI would show it: some task waits for a core while more
        # tools run than there are cores for them.
        contended = self.cpu.running > self.cpu.cpus
        return CpuPressure(sampled_at=now, source="sim",
                           psi_some_avg10=100.0 if contended else 0.0,
                           tool_cpus=self.setup.tool_cpus)

    def tick(self, now: float) -> Outcome:
        observed, cpu = self.observe(now), self.cpu_reading(now)
        self._in("tick", now, observed=observed, cpu=cpu)
        return self.plane.tick(now, observed, at=now, cpu=cpu)

    def sample(self, now: float) -> None:
        """After a control tick has been carried out: state snapshots and pressure samples."""
        self._ticks += 1
        if self.setup.state_every_s > 0 and now >= self._next_state_s:
            self._snapshot(now)
        if self._ticks % self.setup.pressure_every == 0:
            for w, s in self.plane.signals.items():
                eng = self.engines[w].stats()
                self.record(PressureSample(
                    ts=now, worker=w, kv_usage=s.kv_usage, running=eng.running,
                    waiting=eng.waiting, tools_in_flight=s.tools_in_flight,
                    backlog_ratio=s.backlog_ratio))

    def expire_due(self) -> float | None:
        """When the driver's next "expire" event goes (``ControlPlane.next_deadline``, as the
        gateway's timer); ``None``: none, or one due no later goes already."""
        at = self.plane.next_deadline()
        if at is None or (self._expire_at is not None and self._expire_at <= at):
            return None
        self._expire_at = at
        return at

    def expire(self, now: float) -> Outcome | None:
        """An "expire" event: the holds due end (``None``: none is due any more)."""
        if self._expire_at is not None and now >= self._expire_at:
            self._expire_at = None
        at = self.plane.next_deadline()
        if at is None or at > now:  # its session came back, or nobody waits any more
            return None
        self._in("expire", now)
        return self.plane.expire(now)

    def sched_tick(self, now: float) -> list[Ticket]:
        observed = self.observe(now)
        self._in("sched_tick", now, observed=observed)
        return self.plane.sched_tick(now, observed)[1]

    def release(self, now: float) -> list[Ticket]:
        """A call held for a session due back may go now (``SchedulerCore.next_release_at``)."""
        self._in("release", now)
        return self.plane.release(now)

    def _snapshot(self, now: float) -> None:
        engines = {}
        for w, eng in self.engines.items():
            st = eng.stats()
            engines[w] = {"running": st.running, "waiting": st.waiting,
                          "kv_usage": eng.kv.usage, "preemptions_total": eng.num_preemptions}
        self.states.append({"time": now, "admission": core_state(self.plane.admission, now),
                            "engines": engines})
        self._next_state_s = now + self.setup.state_every_s

    def record(self, ev: Event) -> None:
        if ev.type in _TIMELINE_TYPES:
            self.events.append(event_to_dict(ev))
