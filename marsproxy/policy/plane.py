"""The control plane: every decision the proxy makes about a session, in one pure object.

It composes the admission core (window, queue, KV fit, idle timeouts), the scheduler core
(levels, gated dispatch, retention), placement (the admission core's, also with admission
off), the tool-phase tracker and its CPU signal, and one prompt estimator. A driver (the
gateway's shells, the simulator) feeds it events and carries out the :class:`Outcome` that
comes back; it decides nothing itself.

A session's phases (:class:`Phase`): *waiting* in the admission queue, *pending* (admitted
here, its slot not yet confirmed by the window store), *in a call*, *dormant* (between calls),
*ended*. Store answers enter as :meth:`confirm`, :meth:`withdraw` and :meth:`lost`; timer
expiries in :meth:`tick`, and KV holds that end while sessions wait in :meth:`expire`, which
the driver calls at :meth:`next_deadline`.

Two clocks: ``now`` is the control clock (monotonic in the gateway); tool phases are timed on
the tool clock ``at`` (wall time in the gateway, as clients report tool events with epoch
timestamps). The simulator passes its one virtual clock as both. Pure code: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial

from marsproxy.aimd.admission import Actions, AdmissionCore, DecisionKind, Expiry, WorkerSignals
from marsproxy.aimd.order_index import QueueEntry
from marsproxy.config import MarsConfig
from marsproxy.core.answers import AnswerTally, ReplyKind
from marsproxy.core.events import Event
from marsproxy.core.session_record import EndReason, SessionState
from marsproxy.policy.kv_facts import correct_ledger, verify_retention
from marsproxy.policy.log import DecisionLog
from marsproxy.policy.observe import WorkerObservation, admission_signals, scheduler_facts
from marsproxy.policy.outcome import Answer, CallEnd, Ended, Outcome, Pending, Phase
from marsproxy.policy.rank import RankKey, rank_keys
from marsproxy.policy.trees import Trees
from marsproxy.probes.cpu import CpuPressure
from marsproxy.probes.tool_phases import ToolPhaseTracker
from marsproxy.probes.tool_signal import ToolCpuSignal, tool_plane
from marsproxy.sched.core import SchedulerCore
from marsproxy.sched.tickets import Ticket, TickResult

# What the plane hands back: importable from here with the plane that makes it.
__all__ = ["Answer", "CallEnd", "ControlPlane", "Ended", "Outcome", "Pending", "Phase"]


class ControlPlane:
    def __init__(self, cfg: MarsConfig, workers: Sequence[str], *, tool_cpus: float,
                 tools: tuple[ToolPhaseTracker, ToolCpuSignal] | None = None,
                 log: DecisionLog | None = None) -> None:
        self.cfg, self.tool_cpus, self.log = cfg, tool_cpus, log
        self.workers = tuple(workers)
        self.admission = AdmissionCore(cfg.admission, self.workers, cfg.placement)
        self.estimator = self.admission.estimator  # the one prompt estimator
        peaks = self.admission.peaks
        s = cfg.scheduler
        self.scheduler = SchedulerCore(s, self.workers, cfg.admission.kv_reserve_frac)
        # Nothing to schedule per call: the fcfs preset is a plain session-affine proxy.
        self.passive = (s.priority_policy == "off" and s.retention_policy == "off"
                        and s.hint_encoder == "none")
        self.tracker, self.tool_signal = tools or tool_plane(cfg.tools, tool_cpus)
        self.admission.overlaps.in_reported_tool = self.tracker.in_reported_tool
        self.observed = dict.fromkeys(self.workers, WorkerObservation())
        self.signals: dict[str, WorkerSignals] = {}  # what the admission core heard last tick
        self._arrival: dict[str, float] = {}  # waiting in the core since
        self._pending: dict[str, Pending] = {}
        self._held: dict[str, str] = {}  # confirmed session → worker
        self.kv_events: list[Event] = []  # retention verified, corrected: the driver publishes
        self._ledger_grace_s = cfg.probes.tuning.kv_events.ledger_grace_s
        self.trees = Trees()  # agent trees (parent → children): policy/trees.py
        t = cfg.admission.tuning  # whose answers end their sessions: core/answers.py
        self.answers = AnswerTally(t.return_history, t.kv_hold_min_s)
        self.scheduler.parent_of = self.trees.parent_of
        yields = self.admission.yields  # who gives way in the engine: aimd/yields.py
        self.scheduler.yield_rank = yields.rank
        self.scheduler.protected_tokens = partial(peaks.committed_tokens, without=yields.yields)
        self.scheduler.one_shot = yields.first_class_task

    # -- reading ------------------------------------------------------------------------------
    def phase(self, key: str) -> Phase:
        rec = self.admission.sessions.get(key)
        if rec is None or rec.state is not SessionState.ADMITTED:
            return Phase.ENDED if rec is None else Phase.WAITING
        if key in self._pending:
            return Phase.PENDING
        return Phase.IN_CALL if rec.in_flight > 0 else Phase.DORMANT

    def incarnation(self, key: str) -> int | None:
        """Which session of ``key`` lives now (``Answer.incarnation``); ``None``: none."""
        return None if (rec := self.admission.sessions.get(key)) is None else rec.incarnation

    def held(self, key: str) -> str | None:  # the worker of its confirmed slot, if any
        return self._held.get(key)

    def held_on(self, worker: str) -> int:
        return sum(1 for w in self._held.values() if w == worker)

    def pending(self) -> list[tuple[str, Pending]]:
        """Sessions waiting for the store, oldest first."""
        return sorted(self._pending.items(), key=lambda kv: kv[1].since)

    def pending_of(self, key: str) -> Pending | None:
        return self._pending.get(key)

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def rank_keys(self, counters: Mapping[str, float]) -> dict[str, RankKey]:
        """Pending sessions' places in the store's queue; ``counters``: the tenants' (rank.py)."""
        return rank_keys(self.pending(), counters, self.cfg.admission.classes.rank,
                         self.admission.queue.shares.cost)

    # -- requests -----------------------------------------------------------------------------
    def wants_tick(self, key: str) -> bool:
        """Whether the driver should tick (with what it observes now) before a request of
        ``key``: nothing is known of any worker yet (just started), and it holds no slot."""
        return self._held.get(key) is None and self.admission.all_stale()

    def request(
        self, now: float, key: str, tenant: str, *, chars: int = 0, tokens: int | None = None,
        final: bool = False, cls: str | None = None, prefix: Mapping[str, int] | None = None,
        parent: str | None = None, parent_elsewhere: bool = False, bound: str | None = None,
    ) -> Answer:
        """A request of ``key`` arrives: serve it, hold it, or refuse it. ``tokens``: its
        prompt's size (else estimated from ``chars``); ``cls``: a new session's class;
        ``prefix``: its prompt's resident tokens per indexed worker (prefix placement);
        ``parent``: a new one's parent (agent trees), ``parent_elsewhere``: admitted on
        another replica: a child all the same; ``bound``: a new one's only worker."""
        core = self.admission
        self.answers.arrived(key, now)
        child = parent is not None and self.cfg.sessions.trees and (
            self._link(now, key, parent)
            or (parent_elsewhere and self.phase(key) is Phase.ENDED
                and self.phase(parent) is Phase.ENDED))
        self._ledger()
        est = tokens if tokens is not None else self.estimator.estimate(key, chars)
        d = core.on_request(now, key, tenant, est, final=final, cls=cls, prefix=prefix,
                            child=child, bound=bound)
        out = Outcome()
        self._absorb(now, d.actions, out)  # others admitted in the same pass go first
        if d.kind is DecisionKind.WAIT:
            self._arrival.setdefault(key, now)
        elif d.kind is DecisionKind.REJECT:
            self.trees.ended(key)
            self._note(now, "refuse", key, d.reason)
        elif d.worker is not None and d.reason == "admission_disabled":
            self._confirm(now, key, d.worker)  # no window: nothing for a store to confirm
        elif d.worker is not None and d.reason == "admitted":
            self._arrival.setdefault(key, now)
            self._propose(key, d.worker, d.idle, out, d.entry)
        return Answer(d.kind, d.worker, d.status, d.retry_after_s, d.reason, out,
                      None if d.kind is DecisionKind.REJECT else self.incarnation(key))

    def adopt(self, now: float, key: str, tenant: str, worker: str, *, chars: int,
              final: bool, turns: int, correction: float | None) -> None:
        """A session another replica admitted on ``worker``; its lease is ours now."""
        if correction is not None:
            self.estimator.restore(key, correction)
        est = self.estimator.estimate(key, chars)
        self.admission.on_adopt(now, key, tenant, worker, est, final=final, turns=turns)
        self._held[key] = worker
        self._note(now, "adopt", key, worker)

    # -- store answers --------------------------------------------------------------------------
    def confirm(self, now: float, key: str, worker: str | None = None) -> Pending | None:
        """The store confirmed ``key``'s slot: what it waited as (``None``: not pending). On
        ``worker``: another replica admitted the session there first; it goes there."""
        p = self._pending.pop(key, None)
        if p is not None and worker is not None and worker != p.worker:
            self.admission.move(key, worker, p.est_tokens)  # as admitted: its promise
            p.worker = worker
        if p is not None:
            self._confirm(now, key, p.worker)
        return p

    def withdraw(self, now: float, key: str) -> Outcome:
        """A session not served yet goes (its client left, or ``on_store_failure: closed``)."""
        return self._ending(now, key, EndReason.ABANDONED)

    def waiter_left(self, key: str) -> None:
        """One of several waiting requests of ``key`` went (its client left); the rest wait."""
        self.admission.sessions.remove_waiter(key)

    def lost(self, now: float, key: str, worker: str) -> Outcome:
        """The store lost ``key``'s lease on ``worker`` (taken over, ended, or expired)."""
        if self._held.get(key) != worker:
            return Outcome()
        del self._held[key]  # not ours to release any more
        return self.session_end(now, key, EndReason.MOVED)  # its tools, its KV: elsewhere now

    def relocate(self, now: float, key: str, room: Mapping[str, int]) -> str | None:
        """``key``'s worker is full across replicas: move it to a worker with room, if it
        was not served yet and fits there (``room``: free slots per worker in the store)."""
        p = self._pending.get(key)
        if p is None or p.idle or room.get(p.worker, 0) > 0:
            return None
        others = [w for w, n in room.items() if n > 0 and w != p.worker]
        moved = self.admission.relocate(now, key, others)
        if moved is not None:
            p.worker = moved
        return moved

    # -- calls ----------------------------------------------------------------------------------
    def call_start(
        self, now: float, key: str, worker: str, *, chars: int = 0, tokens: int | None = None,
        max_new_tokens: int = 0, gate: bool = False, resident_tokens: int | None = None,
    ) -> Ticket | None:
        """A call of ``key`` goes to ``worker``: its level, and whether it waits in the gate
        (:meth:`release` lets it go; ``gate``: also on a priority worker); ``None``: passive.
        ``resident_tokens``: its prompt's resident there (KV events): retention verified."""
        if self.passive:
            return None
        ev = verify_retention(now, self.scheduler.ledger.reservation(key), worker,
                              resident_tokens, self.observed[worker].block_size)
        if ev is not None:
            self.kv_events.append(ev)
            self._note(now, "verified", key, worker, ev.outcome)
        est = tokens if tokens is not None else self.estimator.estimate(key, chars)
        t = self.scheduler.arrive(now, key, worker, est, max_new_tokens=max_new_tokens,
                                  predicted_tool_s=self.tracker.predicted_duration(key),
                                  gate=gate or self.admission.yields.yields(key))
        self._note(now, "level", key, worker, t.level, t.priority, t.gated)
        return t

    def release(self, now: float, workers: Sequence[str] | None = None) -> list[Ticket]:
        return self.scheduler.release(now, workers)

    def cancel(self, now: float, ticket: Ticket) -> list[Ticket]:
        """A gated call's client left: free what it holds; returns what that lets go."""
        self.scheduler.cancel(ticket.call)
        return self.scheduler.release(now, [ticket.worker])

    def call_end(
        self, now: float, key: str, ticket: Ticket | None, *, incarnation: int | None,
        ok: bool, admitted: bool, prompt_tokens: int | None, completion_tokens: int = 0,
        cached_tokens: int = 0, chars: int = 0, engine_s: float = 0.0, continues: bool = True,
        usual_tool_s: float | None = None, reply: ReplyKind | None = None,
    ) -> CallEnd:
        """A call ended (well or not): the scheduler hears it (retention), then admission (a
        final call ends the session). ``incarnation``: its request's session; ``usual_tool_s``:
        carried from a replica where the tracker has none; ``reply``: its kind, where read (an
        answer may end the session: ``core/answers.py``)."""
        rec = self.admission.sessions.get(key)
        if orphan := (rec is not None and incarnation not in (None, rec.incarnation)):
            rec, admitted, continues = None, False, False  # its session ended: not the new one's
        # Its answer, with no other call of it running: its task is done.
        answered = (rec is not None and self.answers.ends_task(rec.tenant, reply)
                    and continues and rec.in_flight == 1)
        if rec is not None and reply is ReplyKind.ANSWER and continues:
            self.answers.answered(key, rec.tenant, now)  # ended or not: does it come back?
        continues = continues and not answered
        result, released = None, []
        predicted = self.tracker.predicted_duration(key)  # once: both planes read it
        if ticket is not None:
            result = self.scheduler.end(
                now, ticket.call, ok=ok, prompt_tokens=prompt_tokens or 0, engine_s=engine_s,
                completion_tokens=completion_tokens, cached_tokens=cached_tokens,
                predicted_tool_s=predicted, session_continues=continues, charged=not orphan)
            if result.retention is not None and self.cfg.scheduler.retention_policy != "off":
                self._note(now, "retain", key, result.retention.retain, result.retention.blocks)
            released = self.scheduler.release(now, [ticket.worker])
        out = Outcome()
        if ticket is not None and rec is None and not orphan:  # ended first: forget it again
            out.returned += filter(None, [self.scheduler.session_ended(key)])
        if admitted:
            self._absorb(now, self.admission.on_response_end(
                now, key, prompt_chars=chars, prompt_tokens=prompt_tokens or None,
                usual_tool_s=predicted if predicted is not None else usual_tool_s,
                completion_tokens=completion_tokens, cached_tokens=cached_tokens), out)
        if answered:
            out.extend(self.session_end(now, key, EndReason.ANSWERED))
        elif self.trees.has_children(key) and not orphan:
            self._parent_waits(now, key)
        return CallEnd(result, released, out, answered=answered)

    def session_end(self, now: float, key: str, reason: EndReason) -> Outcome:
        """The session is over for its client (final turn, DELETE, idle, evicted, left)."""
        self.tracker.session_ended(key)
        returned = self.scheduler.session_ended(key)
        out = self._ending(now, key, reason)
        out.returned += [] if returned is None else [returned]
        return out

    # -- time -----------------------------------------------------------------------------------
    def tick(self, now: float, observed: Mapping[str, WorkerObservation], *, at: float,
             cpu: CpuPressure | None, elsewhere: Mapping[str, int] | None = None) -> Outcome:
        """The control step: signals from what was observed, the admission core's tick, the
        pending deadlines. ``at``: the tool clock; ``cpu``: the tools' host as last read;
        ``elsewhere``: sessions other replicas hold per worker."""
        self.observed.update(observed)
        self.answers.expire(now)
        self.tool_signal.observe(cpu)
        tools = self.tool_signal.signals(self.tracker, at)
        self.signals = signals = {
            w: admission_signals(self.observed[w], tools, self.tool_cpus,
                                 retained_blocks=self.scheduler.retained_blocks(w),
                                 sessions_elsewhere=(elsewhere or {}).get(w, 0))
            for w in self.workers
        }
        out = self._absorb(now, self.admission.tick(now, signals), Outcome())
        self._expire_pending(now, out)
        return out

    def next_deadline(self) -> float | None:
        """When :meth:`expire` is due: a KV hold ends while sessions wait (``None``: never)."""
        return self.admission.next_deadline()

    def expire(self, now: float) -> Outcome:
        """At :meth:`next_deadline`: holds due end; who waits for their room goes in now."""
        self._ledger()
        return self._absorb(now, self.admission.expire(now), Outcome())

    def sched_tick(self, now: float, observed: Mapping[str, WorkerObservation]) -> tuple[
            TickResult, list[Ticket]]:
        """The scheduler's step: fresh facts, reservation expiries and drops, releases."""
        self.observed.update(observed)
        for w in self.workers:
            obs = self.observed[w]
            self.scheduler.set_facts(w, scheduler_facts(obs))
            if obs.session_blocks is not None:  # what the engine evicted of retained prefixes
                self.kv_events += correct_ledger(now, self.scheduler.ledger, w,
                                                 obs.session_blocks, self._ledger_grace_s)
        return self.scheduler.tick(now), self.scheduler.release(now)

    # -- internals ------------------------------------------------------------------------------
    def _link(self, now: float, key: str, parent: str) -> bool:
        """Link a new session to ``parent``; True: the parent is admitted (it waits on it)."""
        if self.phase(key) is not Phase.ENDED or self.phase(parent) is Phase.ENDED:
            return False  # not new, or a parent unknown here: a plain session
        if not self.trees.link(key, parent):
            return False
        self._note(now, "child", key, parent)
        if self.phase(parent) is Phase.WAITING:
            return False
        self._parent_waits(now, parent)
        return True

    def _parent_waits(self, now: float, parent: str) -> None:
        # A dormant parent waits on its live children: its hold (forecast, prefix) ends now.
        if self.phase(parent) is not Phase.DORMANT:
            return
        held = self.admission.release_hold(parent)
        r = self.scheduler.ledger.release_on_return(parent)
        if held or r is not None:
            self._note(now, "tree_wait", parent, 0 if r is None else r.blocks)

    def _ledger(self) -> None:
        if not self.passive:  # the ledger as it is now, not as of the last tick
            for w in self.workers:
                self.admission.set_retained(w, self.scheduler.retained_blocks(w))

    def _note(self, now: float, kind: str, key: str, *detail: object) -> None:
        if self.log is not None:
            self.log.add(now, kind, key, *detail)

    def _confirm(self, now: float, key: str, worker: str) -> None:
        self._held[key] = worker
        self._note(now, "admit", key, worker)

    def _propose(self, key: str, worker: str, idle: bool, out: Outcome,
                 e: QueueEntry | None) -> None:
        p = Pending(worker, self._arrival.pop(key, 0.0), idle)
        if e is not None:
            p.tenant, p.cls, p.child, p.est_tokens = e.tenant, e.cls, e.child, e.est_tokens
        self._pending[key] = p
        out.proposed.append(key)

    def _absorb(self, now: float, actions: Actions, out: Outcome) -> Outcome:
        for a in actions.admitted:
            self._arrival.setdefault(a.entry.session, now)
            self._propose(a.entry.session, a.worker, a.idle, out, a.entry)
        for e in actions.expired:
            self._arrival.pop(e.session, None)
            self._note(now, "refuse", e.session, e.reason)
            out.expired.append(e)
        for key, reason in actions.ended:
            self._arrival.pop(key, None)
            self.trees.ended(key)
            self._note(now, "end", key, str(reason))
            out.ended.append(Ended(key, reason, self._held.pop(key, None),
                                   self._pending.pop(key, None)))
        for wc in actions.window_changes:
            self._note(now, "window", wc.worker or "", wc.new, wc.reason)
        out.events.extend(actions.events)
        return out

    def _ending(self, now: float, key: str, reason: EndReason) -> Outcome:
        return self._absorb(now, self.admission.on_session_end(now, key, reason), Outcome())

    def _expire_pending(self, now: float, out: Outcome) -> None:
        deadline = self.cfg.admission.queue_deadline_s  # the core's covers its queue only
        for key, p in list(self._pending.items()):
            if now - p.since < deadline:
                continue
            retry = self.admission.queue.retry_after(now)
            out.expired.append(Expiry(key, 503, retry, "queue_deadline"))
            self._note(now, "refuse", key, "queue_deadline")
            out.extend(self._ending(now, key, EndReason.QUEUE_DEADLINE))

