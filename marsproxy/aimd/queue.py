"""The admission queue and the global load balancer.

Waiting sessions are ordered by the load: arrival order while everything fits, and while tool
CPUs are the bottleneck (a first prompt hardly tells a session's tool work apart, so no order by
prompt length would favour tool-light work), otherwise shortest first (most sessions per
block). Long sessions are capped per worker while short ones wait, and packed into a fraction
of free KV once only long ones remain.

Reordering must not make anyone miss a deadline. A session is *urgent* when its slack no
longer covers admitting it and every session due before it at the observed admission rate
(plus ``aging_margin_s``), or when ``max_bypass`` later arrivals were admitted ahead of it.
Urgent sessions go first, in deadline order (least laxity first: at light load that is almost
nobody, so the load-based order rules; in overload it approaches arrival order). One that is
within the margin of its deadline, or bypassed too often, and does not fit stops the pass, so
capacity frees up for it instead of going to those behind it. When nothing fits, a worker that
holds no session takes the oldest anyway: waiting could never end otherwise.

Children of admitted parents (agent trees) come first of all, in a lane of their own
(``lanes.py``). Service classes (``admission.classes``) come next: a pass walks the classes in
their configured order, each as above, and a session of one class that does not fit holds the
capacity against the classes after it. Within a class the tenants take turns by their virtual
token counters (``shares.py``), each offering its sessions in the load's order. A session that
would yield to nobody once admitted is fitted against the KV of the admitted sessions that do
not yield alone (``yields.py``).

Pure code: no I/O; ``now`` is a parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from marsproxy.aimd.config import AdmissionConfig
from marsproxy.aimd.idle import idle_admits
from marsproxy.aimd.lanes import Lanes, Urgency
from marsproxy.aimd.order_index import OrderMode, QueueEntry
from marsproxy.aimd.rate import AdmissionRate, retry_after_s
from marsproxy.aimd.rooms import (
    Admission,
    Offer,
    Room,
    Tally,
    WorkerView,
    max_tokens,
    place,
    room_of,
    take,
)
from marsproxy.aimd.shares import TenantShares

__all__ = ["Admission", "AdmissionQueue", "OrderMode", "QueueEntry", "WorkerView"]


class AdmissionQueue:
    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self.classes = cfg.classes
        self.shares = TenantShares(cfg.tenant_weights)
        self._index = Lanes(self.classes.rank, self.classes.weight, self.shares.weight)
        self.refusal = ""
        """Why the last :meth:`push` refused: queue_full, class_over_share, tenant_over_share."""
        self._seq = 0
        self._rate = AdmissionRate(cfg.tuning.rate_halflife_s)
        self.mode = OrderMode.ARRIVAL
        """The mode of the last pass (also used for reported positions)."""
        self.protected: Callable[[QueueEntry], bool] = lambda e: self.classes.rank(e.cls) == 0
        """Whether a waiting session would yield to nobody once admitted (the core sets it,
        ``yields.py``): it is fitted against ``WorkerView.protected_budget_blocks``."""
        self.waits: Callable[[QueueEntry, str, Sequence[Room]], bool] | None = None
        """Whether a session would rather wait for another worker than take a slot on this
        one (the core sets it with prefix placement, ``prefix.py``)."""

    # -- membership -------------------------------------------------------------------------
    def entry(
        self, session: str, tenant: str, now: float, est_tokens: int, cls: str | None = None,
        *, child: bool = False, grows: bool = True, bound: str | None = None,
    ) -> QueueEntry:
        """A new entry of class ``cls`` (``None`` or unknown: the default) with its class's
        deadline; ``child``: of an admitted parent (its lane first); ``bound``: its only worker."""
        c = cls if cls in self.classes.order else self.classes.default
        deadline = self.classes.deadline_s(c, self.cfg.queue_deadline_s)
        return QueueEntry(session, tenant, now, est_tokens, now + deadline, cls=c, child=child,
                          long=self._is_long(est_tokens), grows=grows, bound=bound)

    def _is_long(self, est_tokens: int) -> bool:  # set by entry() and by push
        return est_tokens > self.cfg.tuning.long_prompt_tokens

    def push(self, entry: QueueEntry) -> bool:
        """Queue ``entry``; False (→ 429, :attr:`refusal` says why) when the queue is full, or
        when the entry's class or tenant holds its weighted share of ``queue_max`` while others
        wait too."""
        if entry.session in self._index:
            raise ValueError(f"session {entry.session!r} is already queued")
        if not entry.cls:
            entry.cls = self.classes.default
        self.refusal = self._over(entry)
        if self.refusal:
            return False
        self._number(entry)
        if not self._index.per_tenant[entry.tenant]:
            self.shares.activate(entry.tenant)
        self._index.add(entry)
        return True

    def _number(self, entry: QueueEntry) -> None:
        self._seq += 1
        entry.seq = self._seq
        entry.long = self._is_long(entry.est_tokens)

    def admit_alone(self, entry: QueueEntry, now: float,
                    workers: Sequence[WorkerView]) -> Admission | None:
        """Nothing waits: admit ``entry`` now if :meth:`push` and :meth:`select` would, leaving
        the same state without building its lanes (every new session at light load). ``None``:
        it would wait; nothing changed. The caller checks that its waiting changes no view."""
        rooms = [] if len(self._index) else self._rooms(workers)
        if not any(r.slots > 0 for r in rooms):
            return None
        shorts_wait = not entry.long  # as the pass counts it, with only this entry waiting
        bound = max_tokens(rooms, shorts_wait, entry.grows)
        room = None
        if bound is None or entry.est_tokens <= bound:
            room, _ = self._place(entry, rooms, shorts_wait)
        forced = room is None
        if room is None:  # _no_deadlock's rule
            empty = _empty(rooms, entry)
            if not empty:
                return None
            room = max(empty, key=Room.rank)
        self._number(entry)
        self.shares.activate(entry.tenant)
        self.mode = self.choose_mode(workers, waiting=1, tokens=entry.est_tokens)
        self.shares.admitted(entry.tenant, entry.session, entry.est_tokens)
        self.shares.settle(())
        self._rate.record(now, 1)
        return Admission(entry, room.view.name, forced=forced)

    def _over(self, e: QueueEntry) -> str:
        cap = self.cfg.queue_max
        if len(self._index) >= cap:
            return "queue_full"
        lanes = self._index
        mine = lanes.waiting(e.cls)
        w = self.classes.weight(e.cls)
        if mine and mine >= _share(cap, w, lanes.class_weights):
            return "class_over_share"
        mine = lanes.per_tenant[e.tenant]
        w = self.shares.weight(e.tenant)
        if mine and mine >= _share(cap, w, lanes.tenant_weights):
            return "tenant_over_share"
        return ""

    def remove(self, session: str) -> QueueEntry | None:
        """Take a session out (its client left, or it was deleted)."""
        e = self._index.discard(session)
        self.shares.settle(self._index.per_tenant)
        return e

    def expire(self, now: float) -> list[QueueEntry]:
        """Take out every session whose deadline has passed (→ 503)."""
        gone = self._index.due(now)
        for e in gone:
            self._index.discard(e.session)
        if gone:
            self.shares.settle(self._index.per_tenant)
        return gone

    # -- shares -----------------------------------------------------------------------------
    def charge(self, tenant: str, session: str, tokens: int) -> None:
        """A response of an admitted session ended: its uncached prompt + completion tokens."""
        self.shares.charge(tenant, session, tokens)

    def forget(self, session: str) -> None:
        """The session ended: drop its admission credit."""
        self.shares.forget(session)

    def __contains__(self, session: object) -> bool:
        return session in self._index

    def per_tenant(self) -> Mapping[str, int]:
        """Waiting sessions per tenant."""
        return self._index.per_tenant

    def __len__(self) -> int:
        return len(self._index)

    def get(self, session: str) -> QueueEntry | None:
        return self._index.get(session)

    def bypasses(self, session: str) -> int:
        """How often later arrivals were admitted while ``session`` waited."""
        e = self._index.get(session)
        return 0 if e is None else self._index.bypasses(e)

    # -- order ------------------------------------------------------------------------------
    def choose_mode(self, workers: Sequence[WorkerView], *, waiting: int | None = None,
                    tokens: int | None = None) -> OrderMode:
        """The pass's order; ``waiting``, ``tokens``: the queue's (count, Σ first prompts)
        when not as it is now."""
        n = len(self._index) if waiting is None else waiting
        live = [w for w in workers if w.placeable]
        if any(w.cpu_overloaded for w in live):
            return OrderMode.ARRIVAL
        if not live or any(w.kv_overloaded for w in live):
            return OrderMode.SHORTEST_FIRST if live else OrderMode.ARRIVAL
        slots = sum(max(0, w.limit - w.admitted) for w in live)
        if n > slots:
            return OrderMode.SHORTEST_FIRST
        if any(w.budget_blocks is None for w in live):
            return OrderMode.ARRIVAL
        room_tokens = sum(max(0, w.budget_blocks or 0) * w.block_size for w in live)
        waiting_tokens = self._index.tokens if tokens is None else tokens
        return OrderMode.ARRIVAL if waiting_tokens <= room_tokens else OrderMode.SHORTEST_FIRST

    def ordered(self, now: float, mode: OrderMode | None = None) -> list[QueueEntry]:
        """Waiting sessions, first to be admitted first."""
        m = self.mode if mode is None else mode
        t = self.cfg.tuning
        urgency = Urgency(now, t.aging_margin_s, t.max_bypass, self._rate.per_second(now))
        tags = self.shares.snapshot(self._index.per_tenant)
        out: list[QueueEntry] = []
        for cls in self._index.classes():
            merge = self._index.fair(cls, m, tags, self._cost, urgency)
            for e, _ in merge:
                out.append(e)
                merge.admitted(e)
        return out

    def _cost(self, e: QueueEntry) -> float:
        return self.shares.cost(e.tenant, e.est_tokens)

    def positions(self, now: float) -> list[tuple[str, int]]:
        """(session, 0-based position) in the order of the last pass, for the admin API."""
        return [(e.session, i) for i, e in enumerate(self.ordered(now))]

    # -- the load balancer ------------------------------------------------------------------
    def select(self, now: float, workers: Sequence[WorkerView]) -> list[Admission]:
        """Admit what fits now; the admitted entries leave the queue."""
        self.mode = self.choose_mode(workers)
        rooms = self._rooms(workers)
        out: list[Admission] = []
        if len(self._index) == 1 and any(r.slots > 0 for r in rooms):
            out = self._alone(rooms) or self._no_deadlock(rooms)  # light load: no order to walk
        elif len(self._index) and any(r.slots > 0 for r in rooms):
            out = self._pass(now, rooms) or self._no_deadlock(rooms)
        if len(self._index) > len(out) and self.cfg.tuning.idle_admit:
            # Also where no slot is free: the idle rule has its own limit (idle_limit).
            out.extend(self._idle_admits(now, rooms, out))
        for a in out:
            self._index.discard(a.entry.session)
            self.shares.admitted(a.entry.tenant, a.entry.session, a.entry.est_tokens)
        if out:
            self._index.note_admitted([a.entry for a in out])
            self.shares.settle(self._index.per_tenant)
        self._rate.record(now, len(out))
        return out

    def _rooms(self, workers: Sequence[WorkerView]) -> list[Room]:
        frac = self.cfg.tuning.long_pack_frac
        return [room_of(w, i, frac) for i, w in enumerate(workers) if w.placeable]

    def _place(self, e: QueueEntry, rooms: list[Room], shorts_wait: bool) -> tuple[
        Room | None, bool
    ]:
        return place(e, rooms, shorts_wait, protected=self.protected(e),
                     max_long=self.cfg.tuning.max_long_in_flight)

    def _pass(self, now: float, rooms: list[Room]) -> list[Admission]:
        # Class by class, the tenants in turn, each with its urgent sessions first (deadline
        # order), then the mode's order. A class that leaves a session unplaced holds the rest.
        shorts = self._index.shorts
        tally = Tally(sum(r.slots for r in rooms), shorts)
        tally.rebound(rooms)
        out: list[Admission] = []
        t = self.cfg.tuning
        urgency = Urgency(now, t.aging_margin_s, t.max_bypass, self._rate.per_second(now))
        tags = self.shares.snapshot(self._index.per_tenant)
        for cls in self._index.classes():
            blocked = False
            merge = self._index.fair(cls, self.mode, tags, self._cost, urgency)
            for e, urgent in merge:
                got = self._offer(e, rooms, tally, out, now, urgent=urgent)
                if got is Offer.STOP:
                    return out  # no slot left, or one held for an urgent session
                if got is Offer.PLACED:
                    merge.admitted(e)
                elif got is Offer.SKIP:
                    merge.drop(e.tenant)
                blocked = blocked or got in (Offer.HELD, Offer.SKIP)
            if blocked:
                break  # the classes after this one yield the capacity it waits for
        return self._unwait(rooms, tally, out)

    def _unwait(self, rooms: list[Room], tally: Tally, out: list[Admission]) -> list[Admission]:
        # Sessions that let others take a slot while waiting for their prefix's worker take the
        # slots nobody else took: waiting for a prefix never leaves a slot empty.
        for e in tally.waiting:
            room = self._place(e, rooms, tally.shorts > 0)[0] if tally.slots > 0 else None
            if room is not None:
                _taken(e, room, rooms, tally, out)
        return out

    def _alone(self, rooms: list[Room]) -> list[Admission]:
        # One session waits: a pass would offer it first whatever the order, and its offer
        # decides the pass (placed, or nothing is). The same bound and room as _offer's.
        e = self._index.only()
        shorts = self._index.shorts
        bound = max_tokens(rooms, shorts > 0, e.grows)
        if bound is not None and e.est_tokens > bound:
            return []
        room, _ = self._place(e, rooms, shorts > 0)
        return [] if room is None else [Admission(e, room.view.name)]

    def _holds(self, e: QueueEntry, now: float) -> bool:
        # Only a session about to miss its deadline, or bypassed too often, stops the others;
        # the rest of the critical prefix goes first when it fits but lets others backfill.
        return (e.deadline - now <= self.cfg.tuning.aging_margin_s
                or self._index.bypasses(e) >= self.cfg.tuning.max_bypass)

    def _offer(
        self, e: QueueEntry, rooms: list[Room], tally: Tally, out: list[Admission],
        now: float, *, urgent: bool,
    ) -> Offer:
        """Place ``e`` if it fits, or say how the pass goes on."""
        if tally.slots <= 0:
            return Offer.STOP
        if tally.beyond(e):
            room, capped = None, False  # too large for every room: no need to look
        else:
            room, capped = self._place(e, rooms, tally.shorts > 0)
        if (room is not None and self.waits is not None and self.waits(e, room.view.name, rooms)
                and not self._holds(e, now)):
            tally.waiting.append(e)
            return Offer.PASSED
        if room is None:
            if capped:
                return Offer.PASSED  # only the long cap stood in the way: others may go
            if urgent and self._holds(e, now):
                return Offer.STOP  # hold the capacity for it rather than hand it to others
            if tally.flat_bound is not None and tally.flat_bound < self._index.smallest_tokens():
                return Offer.STOP  # the smallest waiting fits nowhere, even if it will not grow
            if not urgent and self.mode is OrderMode.SHORTEST_FIRST:
                return Offer.SKIP  # its tenant's later sessions are larger: none fits either
            return Offer.HELD
        _taken(e, room, rooms, tally, out)
        return Offer.PLACED

    def _idle_admits(self, now: float, rooms: list[Room], taken: list[Admission]) -> list[
        Admission
    ]:
        return idle_admits(rooms, taken, lambda: self.ordered(now), self.cfg.tuning,
                           lambda e: self._holds(e, now))

    def _no_deadlock(self, rooms: list[Room]) -> list[Admission]:
        # A worker holding no session takes the oldest, fitting or not: a prompt above the KV
        # reserve would wait forever, and nothing admitted there needs the room.
        oldest = self._index.oldest()
        empty = [] if oldest is None else _empty(rooms, oldest)
        if oldest is None or not empty:
            return []
        return [Admission(oldest, max(empty, key=Room.rank).view.name, forced=True)]
    # -- Retry-After ------------------------------------------------------------------------
    def admission_rate(self, now: float) -> float | None:
        return self._rate.per_second(now)

    def retry_after(self, now: float, ahead: int | None = None, *,
                    tenant: str | None = None) -> int:
        """Seconds a client should wait: sessions ahead / observed admission rate, clamped.
        With ``tenant``: its own waiting sessions over its weighted share of the rate."""
        n = len(self._index) if ahead is None else ahead
        rate = self._rate.per_second(now)
        if tenant is not None:
            per = self._index.per_tenant
            n = per[tenant] if ahead is None else ahead
            w = self.shares.weight(tenant)
            total = self._index.tenant_weights + (0.0 if per[tenant] else w)
            rate = None if rate is None else rate * w / max(w, total)
        return retry_after_s(
            n, rate, self.cfg.tuning.retry_after_min_s, self.cfg.tuning.retry_after_max_s,
        )


def _share(cap: int, weight: float, total: float) -> int:
    """The most sessions a waiting claimant (a class, a tenant) may hold: its weighted part of
    ``cap``, ``total`` being the weights of all that wait, itself included (alone: all)."""
    return cap if total <= weight * (1 + 1e-9) else max(1, math.ceil(cap * weight / total))


def _taken(e: QueueEntry, room: Room, rooms: list[Room], tally: Tally, out: list[Admission],
           ) -> None:  # e placed on room in a pass: the room and the pass's tally take it
    take(room, e)
    tally.slots -= 1
    tally.shorts -= 0 if e.long else 1
    tally.rebound(rooms)
    out.append(Admission(e, room.view.name))


def _empty(rooms: list[Room], e: QueueEntry) -> list[Room]:  # free, nobody admitted, e may go
    return [r for r in rooms if r.slots > 0 and r.view.admitted == 0
            and (e.bound is None or r.view.name == e.bound)]
