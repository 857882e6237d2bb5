"""The scheduler core: what happens to each continuation, and after it.

One object that the gateway shell and a simulator both drive with events, all pure and
clock-injected (``now`` is a parameter; no I/O):

- ``arrive``: a continuation of an admitted session is ready for its worker. It gets a level
  (``las`` only), an order key (``priority``: the vLLM body value, lower first), a
  provisional retention hint, and either goes at once (``priority`` workers, or no policy) or
  waits in the worker's gated dispatch queue.
- ``release`` (:mod:`marsproxy.sched.gate`): which gated continuations may go now: ordered by
  (aged) level, while the worker's in-flight count is under its cap (``max_num_seqs``) and
  their KV fits the budget; a head that does not fit lets smaller ones pass, a bounded number
  of times. On an idle worker the head goes even so, unless it yields to a session due back
  (``next_release_at``: when the driver should ask again).
- ``end``: a call finished: attained service (``las``), warm-resume accounting, the retention
  decision for the coming tool phase and its reservation in the KV ledger.
- ``tick``: reservations whose TTL ended go; under KV pressure dormant sessions' reservations
  are dropped, least urgent first.
- ``session_ended``: forget the session.

Retention is made real on stock vLLM by the ledger: ``retained_blocks(worker)`` goes into the
admission budget and into the dispatch gate, so new work cannot push a retained prefix out.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Literal

from marsproxy.core.kv import blocks_for_tokens
from marsproxy.sched.config import SchedulerConfig
from marsproxy.sched.gate import DispatchGate
from marsproxy.sched.ledger import KvLedger, Reservation
from marsproxy.sched.priority import LOWEST, SessionService, demotion, service_of
from marsproxy.sched.retention import decide
from marsproxy.sched.tickets import (
    EndResult,
    Mode,
    ResumeStats,
    SessionRecord,
    Ticket,
    TickResult,
    WorkerFacts,
)

# A yielding session's engine priority goes past every other's: levels and session ordinals
# (session_fcfs counts sessions since start) stay far below it.
_YIELD_STEP = 1 << 40


class SchedulerCore(DispatchGate):
    def __init__(
        self, cfg: SchedulerConfig, workers: Sequence[str], kv_reserve_frac: float
    ) -> None:
        self.cfg = cfg
        # admission.kv_reserve_frac: the one KV reserve that admission and this gate keep.
        self.kv_reserve_frac = kv_reserve_frac
        self.workers = list(workers)
        self.modes: dict[str, Mode] = dict.fromkeys(workers, "gated")
        self.facts: dict[str, WorkerFacts] = {w: WorkerFacts() for w in workers}
        self.ledger = KvLedger()
        self.service = SessionService()
        self.resumes = ResumeStats()
        self._sessions: dict[str, SessionRecord] = {}
        self._ordinal = itertools.count()
        self._calls = itertools.count(1)
        self._queues: dict[str, list[Ticket]] = {w: [] for w in workers}
        self._running: dict[str, dict[int, Ticket]] = {w: {} for w in workers}
        self._by_call: dict[int, Ticket] = {}
        self.dispatched_total: dict[str, int] = dict.fromkeys(workers, 0)
        self.backfilled_total = 0
        self.levels_total: dict[int, int] = dict.fromkeys(range(LOWEST + 1), 0)
        self.parent_of: Callable[[str], str | None] = lambda _s: None
        """A session's parent (agent trees; the plane sets it): see :meth:`_inherit`."""
        self._held_until: dict[str, float] = {}  # worker → when a call held for a session
        # due back there may go (_due_back)
        self.yield_rank: Callable[[str], int] = lambda _s: 0
        """How far a session yields to others (0: not at all; ``aimd/yields.py``, the plane
        sets it): its calls go after theirs, in the gate and in the engine's priority."""
        self.protected_tokens: Callable[[str], int] = lambda _w: 0
        """The KV the sessions that yield to nobody on a worker are forecast to hold (the
        plane sets it): a yielding session's call is released only beside it (:meth:`_fits`)."""
        self.one_shot: Callable[[str], bool] = lambda _s: False
        """Whether a session is a one-shot task of the first class (the plane sets it:
        ``Yields.first_class_task``): its calls are held by the cap alone, yielding or not."""

    # -- configuration from the shell -----------------------------------------------------
    @property
    def enabled(self) -> bool:
        """False for ``priority_policy: off``: no levels, no gating, no priority hints."""
        return self.cfg.priority_policy != "off"

    def set_mode(self, worker: str, mode: Mode) -> None:
        self.modes[worker] = mode

    def set_facts(self, worker: str, facts: WorkerFacts) -> None:
        self.facts[worker] = facts

    # -- a continuation arrives -----------------------------------------------------------
    def arrive(
        self,
        now: float,
        session: str,
        worker: str,
        prompt_tokens: int,
        *,
        max_new_tokens: int = 0,
        predicted_tool_s: float | None = None,
        gate: bool = False,
    ) -> Ticket:
        """A continuation of ``session`` for ``worker``; ``prompt_tokens`` is an estimate.

        ``gate``: it waits in the dispatch gate even on a ``priority`` worker (its route carries
        no priority). The session is back from its tool phase, so its reservation (if any) is
        released: the prefix is in use again; it was warm if the reservation was still live.
        """
        sess = self._sessions.get(session)
        if sess is None:
            sess = self._sessions[session] = SessionRecord(next(self._ordinal))
        sess.worker, sess.dormant_since = worker, None
        held = self.ledger.release_on_return(session)
        warm = held is not None and held.expires_at > now and held.worker == worker
        cached = min(sess.context_tokens, prompt_tokens) if warm else 0
        uncached = max(0, prompt_tokens - cached)
        lvl, prio = self._inherit(session, *self._level(sess, session))
        rank = self.yield_rank(session)
        if rank and prio is not None:
            prio += rank * _YIELD_STEP
        sess.level = lvl
        # vLLM allocates output blocks as it decodes, not max_tokens up front (agents send
        # 4k-32k): count what the session's last call wrote, within max_tokens; the KV reserve
        # covers the rest.
        out = sess.output_tokens
        if max_new_tokens > 0:
            out = min(out, max_new_tokens)
        blocks = blocks_for_tokens(prompt_tokens + out, self.facts[worker].block_size or 16)
        t = Ticket(
            call=next(self._calls), session=session, worker=worker, level=lvl, priority=prio,
            retain_s=self._retain_hint(worker, prompt_tokens, predicted_tool_s),
            warm=warm, prompt_tokens=prompt_tokens, uncached_tokens=uncached, blocks=blocks,
            arrived=now, gated=self.enabled and (gate or self.modes[worker] == "gated"),
        )
        self._by_call[t.call] = t
        if lvl is not None:
            self.levels_total[lvl] += 1
        if t.gated:
            self._queues[worker].append(t)
        else:
            self._dispatch(now, t)
        return t

    def _level(self, sess: SessionRecord, session: str) -> tuple[int | None, int | None]:
        policy = self.cfg.priority_policy
        if policy == "las":
            lvl = min(LOWEST, demotion(self.service.attained(session), self.cfg))
            return lvl, lvl
        if policy == "session_fcfs":
            return None, sess.ordinal
        return None, None

    def _inherit(self, session: str, lvl: int | None, prio: int | None) -> tuple[
            int | None, int | None]:
        """Agent trees: a child runs at least at its parent's level (of the parent's latest
        call; it waits on the child), and under ``session_fcfs`` in its parent's place."""
        parent = self.parent_of(session)
        p = None if parent is None else self._sessions.get(parent)
        if p is None or prio is None:
            return lvl, prio
        if self.cfg.priority_policy == "session_fcfs":
            return lvl, min(prio, p.ordinal)
        if lvl is None or p.level is None:
            return lvl, prio
        return min(lvl, p.level), min(prio, p.level)

    def _retain_hint(
        self, worker: str, prompt_tokens: int, predicted_tool_s: float | None
    ) -> float | None:
        """What the proxy intends to retain after this call, for cache-aware workers."""
        if self.cfg.retention_policy == "off":
            return None
        f = self.facts[worker]
        out = decide(prompt_tokens, f.prefill_tokens_per_s, predicted_tool_s, self.cfg)
        return out.ttl_s if out.retain else 0.0

    # -- gated dispatch -------------------------------------------------------------------
    def cancel(self, call: int) -> Ticket | None:
        """A continuation left before it went (its client disconnected, or it failed to send):
        it leaves the queue, or stops counting in flight. Returns it if it was known."""
        t = self._by_call.pop(call, None)
        if t is None:
            return None
        if t.dispatched:
            self._running[t.worker].pop(call, None)
        elif t in self._queues[t.worker]:
            self._queues[t.worker].remove(t)
        return t

    def evict(self, worker: str) -> list[Ticket]:
        """``worker`` was ejected: the calls held in its gate leave it (returned, to be placed
        anew), since it takes no new work and its running calls may not end for a long time."""
        held, self._queues[worker] = self._queues[worker], []
        for t in held:
            self._by_call.pop(t.call, None)
        return held

    def moved(self, call: int, worker: str) -> None:
        """The shell sent ``call`` to another worker (failover after a refused connect)."""
        t = self._by_call.get(call)
        if t is None or t.worker == worker or not t.dispatched:
            return
        self._running[t.worker].pop(call, None)
        t.worker = worker
        self._running[worker][call] = t

    # -- a call ends ----------------------------------------------------------------------
    def end(
        self,
        now: float,
        call: int,
        *,
        ok: bool,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        engine_s: float,
        predicted_tool_s: float | None,
        session_continues: bool,
        charged: bool = True,
    ) -> EndResult:
        """The call finished (``ok``: a full response with usage); decide retention.
        ``charged``: False when its session ended since (its key may name a new one): the
        call leaves, nothing of it counts for the session of its key."""
        t = self.cancel(call)
        session = t.session if t is not None else None
        if t is None or session is None:
            return EndResult(None, None, 0, None, None)
        if self.cfg.priority_policy == "las" and charged:  # attained service orders las alone
            self.service.add(
                session, service_of(self.cfg, prompt_tokens, completion_tokens, engine_s))
        sess = self._sessions.get(session) if charged else None
        resume: Literal["warm", "cold"] | None = None
        if sess is not None and ok and prompt_tokens > 0:
            if sess.context_tokens > 0:
                left = min(sess.context_tokens, prompt_tokens)
                hot = cached_tokens >= self.cfg.tuning.warm_resume_min_frac * left
                resume = "warm" if hot else "cold"
                (self.resumes.warm if hot else self.resumes.cold)[t.warm] += 1
                self.resumes.cached_tokens += min(cached_tokens, left)
                self.resumes.context_tokens += left
            sess.context_tokens = prompt_tokens + completion_tokens
            sess.output_tokens = completion_tokens
            sess.calls += 1
            sess.call_s = engine_s
        if sess is not None and session_continues:
            sess.dormant_since = now
        facts = self.facts[t.worker]
        context = prompt_tokens + completion_tokens
        outcome = None
        if ok and session_continues and sess is not None:
            outcome = decide(context, facts.prefill_tokens_per_s, predicted_tool_s, self.cfg,
                             block_size=facts.block_size or 16)
            if outcome.retain and outcome.ttl_s > 0:
                lvl = t.level if t.level is not None else LOWEST
                self.ledger.reserve(session, t.worker, outcome.blocks, now, outcome.ttl_s, lvl)
        return EndResult(t, outcome, context, facts.prefill_tokens_per_s, resume)

    # -- time passes ----------------------------------------------------------------------
    def tick(self, now: float) -> TickResult:
        """TTL expiries, then drops under KV pressure (the worker's usage or the ledger)."""
        expired = self.ledger.expire(now)
        dropped: list[Reservation] = []
        for w in self.workers:
            f = self.facts[w]
            if f.total_blocks is None:
                continue
            need = 0
            usable = self.usable_blocks(w)
            if usable is not None and self.running_blocks(w) > usable:
                need = self.running_blocks(w) - usable
            if f.kv_usage is not None and f.kv_usage >= self.cfg.tuning.retention_drop_kv_usage:
                over = f.kv_usage - self.cfg.tuning.retention_drop_kv_usage
                need = max(need, math.ceil(over * f.total_blocks), 1)
            dropped.extend(self.ledger.drop_under_pressure(w, need))
        return TickResult(expired, dropped)

    def session_ended(self, session: str) -> Reservation | None:
        """Forget the session; its reservation (returned) goes with it."""
        self._sessions.pop(session, None)
        self.service.forget(session)
        return self.ledger.release_on_return(session)

    # -- reading --------------------------------------------------------------------------
    def level_of(self, session: str) -> int | None:
        """The level of the session's latest call (None: none yet, or no levels)."""
        sess = self._sessions.get(session)
        return None if sess is None else sess.level

    def retained_blocks(self, worker: str) -> int:
        return self.ledger.reserved_blocks(worker)

    def ticket(self, call: int) -> Ticket | None:
        return self._by_call.get(call)

    def queue_length(self, worker: str) -> int:
        return len(self._queues[worker])
