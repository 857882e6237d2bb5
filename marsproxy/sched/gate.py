"""The scheduler core's gated dispatch queue: which waiting continuations go to a worker now.

:class:`DispatchGate` is the part of :class:`marsproxy.sched.core.SchedulerCore` that holds the
worker's queue back while its in-flight count is at its cap (``max_num_seqs``), or, for a call
that yields (a later class's), while its KV does not fit beside what runs there, what the ledger
retains and what the sessions it yields to are forecast to need; it orders the queue by (aged)
level, lets smaller calls pass a head that does not fit (a bounded number of times), and holds a
yielding call on an idle worker while a session it yields to is due back. Its state is the
core's (this is its base class).

Other calls are not held for KV: admission keeps the sessions' forecast peaks within the cache,
and the engine takes a call when it has the blocks, as it would without the proxy; holding them
too cost every simulated twin (docs/scheduler.md, "Gated dispatch"). Nor is a one-shot task's
call (its key's sessions never return) of the first class, its tenant over its share or not: its
KV is gone when it ends, and held for the others' forecasts a batch key's tasks beside a few
agents ran at half their throughput. A later class's is held as asked for.

Pure code: no I/O; ``now`` is a parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from marsproxy.core.kv import blocks_for_tokens
from marsproxy.sched.config import SchedulerConfig
from marsproxy.sched.ledger import KvLedger
from marsproxy.sched.priority import promotion
from marsproxy.sched.tickets import SessionRecord, Ticket, WorkerFacts


class DispatchGate:
    """Release decisions of the gated queues (the state is the scheduler core's)."""

    cfg: SchedulerConfig
    kv_reserve_frac: float
    workers: list[str]
    facts: dict[str, WorkerFacts]
    ledger: KvLedger
    backfilled_total: int
    dispatched_total: dict[str, int]
    yield_rank: Callable[[str], int]
    protected_tokens: Callable[[str], int]
    one_shot: Callable[[str], bool]
    _sessions: dict[str, SessionRecord]
    _queues: dict[str, list[Ticket]]
    _running: dict[str, dict[int, Ticket]]
    _held_until: dict[str, float]

    def cap(self, worker: str) -> int:
        """In-flight continuations a gated worker may run (its ``max_num_seqs``)."""
        return self.facts[worker].max_num_seqs or self.cfg.default_max_num_seqs

    def usable_blocks(self, worker: str) -> int | None:
        """KV blocks running continuations may use: total less the reserve and the ledger."""
        total = self.facts[worker].total_blocks
        if total is None:
            return None
        reserve = math.ceil(self.kv_reserve_frac * total)
        return total - reserve - self.ledger.reserved_blocks(worker)

    def running_blocks(self, worker: str) -> int:
        return sum(t.blocks for t in self._running[worker].values())

    def in_flight(self, worker: str) -> int:
        return len(self._running[worker])

    def _order_key(self, now: float, t: Ticket) -> tuple[int, int, int, float, int]:
        # Who yields goes after (a later class, a tenant over its share), then levels.
        aged = t.level
        if aged is not None:
            aged = max(0, aged - promotion(now - t.arrived, self.cfg))
        return (self.yield_rank(t.session), aged if aged is not None else 0, t.priority or 0,
                t.arrived, t.call)

    def queue(self, now: float, worker: str) -> list[Ticket]:
        """The worker's gated queue in release order (aged levels, then arrival)."""
        return sorted(self._queues[worker], key=lambda t: self._order_key(now, t))

    def release(self, now: float, workers: Iterable[str] | None = None) -> list[Ticket]:
        """Gated continuations that go now (marked dispatched; the shell sends them)."""
        out: list[Ticket] = []
        for w in self.workers if workers is None else workers:
            out.extend(self._release_worker(now, w))
        return out

    def _fits(self, worker: str, t: Ticket) -> bool:
        if not self.yield_rank(t.session) or self.one_shot(t.session):
            return True  # held by the cap alone (module doc)
        usable = self.usable_blocks(worker)
        if usable is None:
            return True
        # The engine does not preempt for a waiting call: a yielding session's call leaves the
        # others the room they are forecast to need (less what they run already). One-shot
        # tasks' calls are not waited for: theirs are not (above), and a tenant that yields
        # would wait for another's tasks that are never held.
        need = kept = 0
        for r in self._running[worker].values():  # each running call judged once
            if self.one_shot(r.session):
                continue  # nor is its call part of the protected forecasts it would run into
            need += r.blocks
            if not self.yield_rank(r.session):
                kept += r.blocks
        bs = self.facts[worker].block_size or 16
        need += t.blocks + max(0, blocks_for_tokens(self.protected_tokens(worker), bs) - kept)
        return need <= usable

    def _release_worker(self, now: float, w: str) -> list[Ticket]:
        out: list[Ticket] = []
        self._held_until.pop(w, None)
        while self._queues[w] and self.in_flight(w) < self.cap(w):
            q = self._queues[w]
            order = list(q) if len(q) == 1 else self.queue(now, w)  # one: nothing to order
            head = order[0]
            if not self._fits(w, head):
                # Dormant sessions' reservations go before running work is held back.
                usable = self.usable_blocks(w)
                assert usable is not None
                need = self.running_blocks(w) + head.blocks - usable
                self.ledger.drop_under_pressure(w, need)
            fits = self._fits(w, head)
            until = None if fits or self.in_flight(w) else self._due_back(now, w, head)
            if fits or (self.in_flight(w) == 0 and until is None):
                # Alone on the worker, even an oversized continuation must go (no deadlock),
                # unless it yields to a session due back (:meth:`_due_back`).
                self._take(now, head)
                out.append(head)
                continue
            if until is not None:
                self._held_until[w] = until
            passed = self._backfill(now, w, head, order[1:])
            out.extend(passed)
            break
        return out

    def _due_back(self, now: float, w: str, head: Ticket) -> float | None:
        """Until when ``head``, a call that does not fit beside what the others on the idle
        worker ``w`` are forecast to need, waits all the same (``None``: it goes now). It waits
        when it yields and a session it yields to is in a tool phase, for less time so far than
        ``head``'s session's latest call took, with a context that would not fit beside
        ``head``: the engine does not preempt a running call for a waiting one, so ``head``
        sent now could hold that session's next call back about as long as ``head`` runs.
        Waiting idles the engine at most that long: until the session has been away for that
        time (the earliest such time of the sessions it waits for, when it is looked at again;
        a first call, with no call time to go by, does not wait)."""
        own = self._sessions.get(head.session)
        if own is None or own.call_s is None or not self.yield_rank(head.session):
            return None
        usable = self.usable_blocks(w)
        if usable is None:
            return None
        bs = self.facts[w].block_size or 16
        need = self.running_blocks(w) + head.blocks
        until: float | None = None
        for key, s in self._sessions.items():
            if s.worker != w or s.dormant_since is None:
                continue
            end = s.dormant_since + own.call_s
            if now < end and not self.yield_rank(key):
                need += blocks_for_tokens(s.context_tokens, bs)
                until = end if until is None else min(until, end)
        return until if need > usable else None

    def next_release_at(self) -> float | None:
        """When a call held back for a session due back (:meth:`_due_back`) may go: the
        driver calls :meth:`release` then (``None``: no call is held that way)."""
        return min(self._held_until.values(), default=None)

    def _backfill(self, now: float, w: str, head: Ticket, rest: list[Ticket]) -> list[Ticket]:
        out: list[Ticket] = []
        for t in rest:
            if head.bypassed >= self.cfg.tuning.backfill_max or self.in_flight(w) >= self.cap(w):
                break
            if self._fits(w, t):
                self._take(now, t)
                head.bypassed += 1
                self.backfilled_total += 1
                out.append(t)
        return out

    def _take(self, now: float, t: Ticket) -> None:
        self._queues[t.worker].remove(t)
        self._dispatch(now, t)

    def _dispatch(self, now: float, t: Ticket) -> None:
        t.released_at = now
        self._running[t.worker][t.call] = t
        self.dispatched_total[t.worker] += 1
