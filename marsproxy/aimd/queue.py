"""The admission queue and the global load balancer.

Waiting sessions are ordered by the load: arrival order while everything fits, and while tool
CPUs are the bottleneck (a first prompt hardly tells a session's tool work apart, so no order by
prompt length would favour tool-light work), otherwise shortest first (most sessions per
block). Long sessions are capped per worker while
short ones wait, and packed into a fraction of free KV once only long ones remain.

Reordering must not make anyone miss a deadline. A session is *urgent* when its slack no
longer covers admitting it and every session due before it at the observed admission rate
(plus ``aging_margin_s``), or when ``max_bypass`` later arrivals were admitted ahead of it.
Urgent sessions go first, in deadline order (least laxity first: at light load that is almost
nobody, so the load-based order rules; in overload it approaches arrival order). One that is
within the margin of its deadline, or bypassed too often, and does not fit stops the pass, so
capacity frees up for it instead of going to those behind it. When nothing fits and nothing
runs anywhere, the oldest session is admitted anyway: waiting could never end otherwise.

Pure code: no I/O; ``now`` is a parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from marsproxy.aimd.config import AdmissionConfig
from marsproxy.aimd.order_index import OrderIndex, OrderMode, QueueEntry
from marsproxy.aimd.rate import AdmissionRate, retry_after_s
from marsproxy.core.kv import blocks_for_tokens, fits

__all__ = ["Admission", "AdmissionQueue", "OrderMode", "QueueEntry", "WorkerView"]


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the load balancer needs to know about one worker."""

    name: str
    admitted: int
    limit: int
    """The controller's effective limit."""
    healthy: bool = True
    stale: bool = False
    budget_blocks: int | None = None
    """core.kv.kv_budget; ``None``: the worker reports no block counts."""
    free_blocks: int | None = None
    retained_blocks: int = 0
    peak_room_blocks: int | None = None
    """First-prompt blocks a new session's forecast peak leaves room for (``None``: off); the
    budget includes it already, the long-session pack is bounded by it too."""
    block_size: int = 16
    long_admitted: int = 0
    kv_overloaded: bool = False
    cpu_overloaded: bool = False
    idle_s: float | None = None
    """How long the worker has run nothing while its sessions sit in tool phases (``None``:
    something runs there, or nothing is admitted)."""
    free_budget_blocks: int | None = None
    """The budget without the forecast-peak fit: free blocks now (idle admissions)."""
    idle_limit: int = 0
    """Sessions an idle admission may bring the worker to: the limit without the tool-CPU
    bound while KV is not overloaded (an idle engine is no tool CPU's bottleneck)."""
    held: int | None = None
    """Admitted sessions that hold KV room there (in a call, or dormant within their hold):
    the load placement balances; ``None``: as admitted."""

    @property
    def placeable(self) -> bool:
        # A stale worker cannot be seen, so nothing new goes there (fail closed).
        return self.healthy and not self.stale


@dataclass(frozen=True, slots=True)
class Admission:
    entry: QueueEntry
    worker: str
    forced: bool = False
    """Admitted by the no-deadlock rule, without fitting."""
    idle: bool = False
    """Admitted onto an idle worker past the forecast-peak fit (``admission.tuning.idle_admit``)."""


@dataclass(slots=True)
class _Room:
    # One worker's capacity during one pass, shrinking as sessions are placed.
    view: WorkerView
    index: int
    slots: int
    budget: int | None
    pack: int | None
    long_admitted: int
    placed: int = 0

    def rank(self) -> tuple[int, int]:
        # Fewest sessions holding KV first (an engine with fewer runs each call faster), ties in
        # worker order: with equal loads, as round robin spreads sessions without a proxy.
        load = self.view.admitted if self.view.held is None else self.view.held
        return (-(load + self.placed), -self.index)


@dataclass(slots=True)
class _Tally:
    slots: int  # free slots left in this pass, all workers together
    shorts: int  # short sessions still waiting
    bound: float | None  # no prompt larger than this fits anywhere (None: no limit known)


class AdmissionQueue:
    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self._index = OrderIndex()
        self._seq = 0
        self._rate = AdmissionRate(cfg.tuning.rate_halflife_s)
        self.mode = OrderMode.ARRIVAL
        """The mode of the last pass (also used for reported positions)."""

    # -- membership -------------------------------------------------------------------------
    def entry(self, session: str, tenant: str, now: float, est_tokens: int) -> QueueEntry:
        """A new entry with the configured deadline."""
        return QueueEntry(session, tenant, now, est_tokens, now + self.cfg.queue_deadline_s)

    def push(self, entry: QueueEntry) -> bool:
        """Queue ``entry``; False when the queue is full (→ 429)."""
        if entry.session in self._index:
            raise ValueError(f"session {entry.session!r} is already queued")
        if len(self._index) >= self.cfg.queue_max:
            return False
        self._seq += 1
        entry.seq = self._seq
        entry.long = entry.est_tokens > self.cfg.tuning.long_prompt_tokens
        self._index.add(entry)
        return True

    def remove(self, session: str) -> QueueEntry | None:
        """Take a session out (its client left, or it was deleted)."""
        return self._index.discard(session)

    def expire(self, now: float) -> list[QueueEntry]:
        """Take out every session whose deadline has passed (→ 503)."""
        gone = self._index.due(now)
        for e in gone:
            self._index.discard(e.session)
        return gone

    def __contains__(self, session: object) -> bool:
        return session in self._index

    def __len__(self) -> int:
        return len(self._index)

    def get(self, session: str) -> QueueEntry | None:
        return self._index.get(session)

    def bypasses(self, session: str) -> int:
        """How often later arrivals were admitted while ``session`` waited."""
        e = self._index.get(session)
        return 0 if e is None else self._index.bypasses(e)

    # -- order ------------------------------------------------------------------------------
    def choose_mode(self, workers: Sequence[WorkerView]) -> OrderMode:
        live = [w for w in workers if w.placeable]
        if any(w.cpu_overloaded for w in live):
            return OrderMode.ARRIVAL
        if not live or any(w.kv_overloaded for w in live):
            return OrderMode.SHORTEST_FIRST if live else OrderMode.ARRIVAL
        slots = sum(max(0, w.limit - w.admitted) for w in live)
        if len(self._index) > slots:
            return OrderMode.SHORTEST_FIRST
        if any(w.budget_blocks is None for w in live):
            return OrderMode.ARRIVAL
        room_tokens = sum(max(0, w.budget_blocks or 0) * w.block_size for w in live)
        return OrderMode.ARRIVAL if self._index.tokens <= room_tokens else OrderMode.SHORTEST_FIRST

    def ordered(self, now: float, mode: OrderMode | None = None) -> list[QueueEntry]:
        """Waiting sessions, first to be admitted first."""
        m = self.mode if mode is None else mode
        t = self.cfg.tuning
        return self._index.ordered(now, m, t.aging_margin_s, t.max_bypass,
                                   self._rate.per_second(now))

    def positions(self, now: float) -> list[tuple[str, int]]:
        """(session, 0-based position) in the order of the last pass, for the admin API."""
        return [(e.session, i) for i, e in enumerate(self.ordered(now))]

    # -- the load balancer ------------------------------------------------------------------
    def select(self, now: float, workers: Sequence[WorkerView]) -> list[Admission]:
        """Admit what fits now; the admitted entries leave the queue."""
        self.mode = self.choose_mode(workers)
        rooms = [self._room(w, i) for i, w in enumerate(workers) if w.placeable]
        out: list[Admission] = []
        if len(self._index) and any(r.slots > 0 for r in rooms):
            out = self._pass(now, rooms)
            if not out and not any(w.admitted for w in workers):
                out = self._no_deadlock(rooms)
        if len(self._index) > len(out) and self.cfg.tuning.idle_admit:
            # Also where no slot is free: the idle rule has its own limit (idle_limit).
            out.extend(self._idle_admits(now, rooms, out))
        for a in out:
            self._index.discard(a.entry.session)
        if out:
            self._index.note_admitted(a.entry for a in out)
        self._rate.record(now, len(out))
        return out

    def _room(self, w: WorkerView, index: int) -> _Room:
        pack = None
        if w.free_blocks is not None:
            pack = int(self.cfg.tuning.long_pack_frac * w.free_blocks) - w.retained_blocks
            if w.peak_room_blocks is not None:
                pack = min(pack, w.peak_room_blocks)
        return _Room(w, index, max(0, w.limit - w.admitted), w.budget_blocks, pack,
                     w.long_admitted)

    def _pass(self, now: float, rooms: list[_Room]) -> list[Admission]:
        # Urgent ones first (in deadline order), then the rest in the mode's order.
        shorts = self._index.shorts
        tally = _Tally(sum(r.slots for r in rooms), shorts, self._max_tokens(rooms, shorts > 0))
        out: list[Admission] = []
        held: set[int] = set()
        rate = self._rate.per_second(now)
        t = self.cfg.tuning
        for e in self._index.urgent(now, t.aging_margin_s, t.max_bypass, rate):
            held.add(e.seq)
            if not self._offer(e, rooms, tally, out, now, urgent=True):
                return out
        rest = self._index.in_mode(self.mode, held)
        for e in rest:
            if not self._offer(e, rooms, tally, out, now, urgent=False):
                break
        return out

    def _holds(self, e: QueueEntry, now: float) -> bool:
        # Only a session about to miss its deadline, or bypassed too often, stops the others;
        # the rest of the critical prefix goes first when it fits but lets others backfill.
        return (e.deadline - now <= self.cfg.tuning.aging_margin_s
                or self._index.bypasses(e) >= self.cfg.tuning.max_bypass)

    def _offer(
        self, e: QueueEntry, rooms: list[_Room], tally: _Tally, out: list[Admission],
        now: float, *, urgent: bool,
    ) -> bool:
        """Place ``e`` if it fits; False when the pass should stop."""
        if tally.slots <= 0:
            return False
        if tally.bound is not None and e.est_tokens > tally.bound:
            room, capped = None, False  # too large for every room: no need to look
        else:
            room, capped = self._place(e, rooms, tally.shorts > 0)
        if room is None:
            if capped:
                return True  # only the long cap stood in the way: others may go
            if urgent and self._holds(e, now):
                return False  # hold the capacity for it rather than hand it to those behind
            if tally.bound is not None and tally.bound < self._index.smallest_tokens():
                return False  # not even the smallest waiting session fits anywhere
            # Shortest first: everything behind is larger and cannot fit either.
            return urgent or self.mode is not OrderMode.SHORTEST_FIRST
        self._take(room, e)
        tally.slots -= 1
        tally.shorts -= 0 if e.long else 1
        tally.bound = self._max_tokens(rooms, tally.shorts > 0)
        out.append(Admission(e, room.view.name))
        return True

    def _max_tokens(self, rooms: list[_Room], shorts_wait: bool) -> float | None:
        """The largest prompt any room could take now (``None``: no limit known)."""
        best = 0.0
        for r in rooms:
            if r.slots <= 0:
                continue
            cap = r.budget if shorts_wait or r.pack is None else max(r.pack, r.budget or 0)
            if cap is None:
                return None
            best = max(best, cap * r.view.block_size)
        return best

    def _place(self, e: QueueEntry, rooms: list[_Room], shorts_wait: bool) -> tuple[
        _Room | None, bool
    ]:
        """The room for ``e`` (fewest sessions first) and whether only the long cap stood in
        the way."""
        best: _Room | None = None
        capped = False
        for r in rooms:
            if r.slots <= 0:
                continue
            blocks = blocks_for_tokens(e.est_tokens, r.view.block_size)
            if e.long and shorts_wait:
                if r.long_admitted >= self.cfg.tuning.max_long_in_flight:
                    capped = capped or fits(blocks, r.budget)
                    continue
                ok = fits(blocks, r.budget)
            elif e.long:
                # Only long ones wait: pack them into a fraction of free KV, no count cap.
                ok = fits(blocks, r.pack if r.pack is not None else r.budget)
            else:
                ok = fits(blocks, r.budget)
            if ok and (best is None or r.rank() > best.rank()):
                best = r
        return best, capped and best is None

    @staticmethod
    def _take(room: _Room, e: QueueEntry) -> None:
        blocks = blocks_for_tokens(e.est_tokens, room.view.block_size)
        room.slots -= 1
        room.placed += 1
        if room.budget is not None:
            room.budget -= blocks
        if room.pack is not None:
            room.pack -= blocks
        if e.long:
            room.long_admitted += 1

    def _idle_admits(self, now: float, rooms: list[_Room], taken: list[Admission]) -> list[
        Admission
    ]:
        """One session for each worker idle for ``idle_admit_after_s`` that this pass gave
        none: the first waiting (in this pass's order) whose first prompt fits its free KV."""
        idle = [r for r in rooms if r.view.admitted < r.view.idle_limit
                and r.view.idle_s is not None
                and r.view.idle_s >= self.cfg.tuning.idle_admit_after_s]
        if not idle:
            return []
        busy = {a.worker for a in taken}
        chosen = {a.entry.session for a in taken}
        waiting = [e for e in self.ordered(now) if e.session not in chosen]
        out: list[Admission] = []
        for r in idle:
            if r.view.name in busy:
                continue
            for e in waiting:
                if e.long and r.long_admitted >= self.cfg.tuning.max_long_in_flight:
                    continue
                if fits(blocks_for_tokens(e.est_tokens, r.view.block_size),
                        r.view.free_budget_blocks):
                    out.append(Admission(e, r.view.name, idle=True))
                    waiting.remove(e)
                    break
                if self._holds(e, now):
                    break  # due now: nobody behind it takes the room it waits for
        return out

    def _no_deadlock(self, rooms: list[_Room]) -> list[Admission]:
        free = [r for r in rooms if r.slots > 0]
        oldest = next(iter(self._index.ordered_by_arrival()), None)
        if not free or oldest is None:
            return []
        room = max(free, key=_Room.rank)
        return [Admission(oldest, room.view.name, forced=True)]

    # -- Retry-After ------------------------------------------------------------------------
    def admission_rate(self, now: float) -> float | None:
        return self._rate.per_second(now)

    def retry_after(self, now: float, ahead: int | None = None) -> int:
        """Seconds a client should wait: sessions ahead / observed admission rate, clamped."""
        n = len(self._index) if ahead is None else ahead
        return retry_after_s(
            n, self._rate.per_second(now), self.cfg.tuning.retry_after_min_s,
            self.cfg.tuning.retry_after_max_s,
        )
