"""The waiting sessions by service class and tenant.

Each class keeps one :class:`OrderIndex` for what spans its tenants (expiry, arrival for the
no-deadlock rule), and one per tenant (a *lane*) for that tenant's order: its urgent sessions
(critical at its share of the admission rate, or bypassed too often by its own later sessions)
first, then the load's order (arrival, or shortest first). :class:`FairMerge` walks a class's
tenants by their virtual token counters (``shares.py``): the tenant with the smallest counter
offers its next session, and an admission raises its counter by the session's estimated cost.

Agent trees: a child of an admitted parent waits in the children's lane (:data:`CHILDREN`), a
pseudo-class walked before every configured class, so it is admitted ahead of new sessions and
its parent's work is not held up behind them. Its own class still counts for its deadline and
for the first class's KV reserve.

Pure code: no I/O.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from marsproxy.aimd.order_index import OrderIndex, OrderMode, QueueEntry

__all__ = ["CHILDREN", "FairMerge", "Lanes", "Urgency"]

CHILDREN = "~children"
"""The lane of children of admitted parents: walked first, whatever their class."""


def lane_of(e: QueueEntry) -> str:
    """The lane ``e`` waits in: the children's, or its class's."""
    return CHILDREN if e.child else e.cls


@dataclass(slots=True)
class _Class:
    index: OrderIndex = field(default_factory=OrderIndex)
    tenants: dict[str, OrderIndex] = field(default_factory=dict)


class Lanes:
    def __init__(self, rank: Callable[[str], int], class_weight: Callable[[str], float],
                 tenant_weight: Callable[[str], float]) -> None:
        self._class_rank = rank
        self._weight_of = class_weight
        self._tenant_weight = tenant_weight
        self.class_weights = 0.0
        """Σ weights of the classes with sessions waiting."""
        self.tenant_weights = 0.0
        """Σ weights of the tenants with sessions waiting."""
        self._classes: dict[str, _Class] = {}
        self._where: dict[str, str] = {}  # session → class
        self.per_tenant: Counter[str] = Counter()
        self.tokens = 0
        self.shorts = 0

    def _rank(self, lane: str) -> int:
        return -1 if lane == CHILDREN else self._class_rank(lane)

    def _class_weight(self, lane: str) -> float:
        return 0.0 if lane == CHILDREN else self._weight_of(lane)

    # -- membership ---------------------------------------------------------------------------
    def add(self, e: QueueEntry) -> None:
        key = lane_of(e)
        c = self._classes.get(key)
        if c is None:
            c = self._classes[key] = _Class()
            self.class_weights += self._class_weight(key)
            # Keep the classes in rank order: the passes walk them first to last.
            self._classes = dict(sorted(self._classes.items(), key=lambda kv: self._rank(kv[0])))
        c.index.add(e)
        c.tenants.setdefault(e.tenant, OrderIndex()).add(e)
        self._where[e.session] = key
        if not self.per_tenant[e.tenant]:
            self.tenant_weights += self._tenant_weight(e.tenant)
        self.per_tenant[e.tenant] += 1
        self.tokens += e.est_tokens
        self.shorts += 0 if e.long else 1

    def discard(self, session: str) -> QueueEntry | None:
        cls = self._where.pop(session, None)
        if cls is None:
            return None
        c = self._classes[cls]
        e = c.index.discard(session)
        assert e is not None
        lane = c.tenants[e.tenant]
        lane.discard(session)
        if not len(lane):
            del c.tenants[e.tenant]
        if not len(c.index):
            del self._classes[cls]
            self.class_weights -= self._class_weight(cls)
        self.per_tenant[e.tenant] -= 1
        if self.per_tenant[e.tenant] <= 0:
            del self.per_tenant[e.tenant]
            self.tenant_weights -= self._tenant_weight(e.tenant)
        if not self._where:  # no float drift left over
            self.class_weights = self.tenant_weights = 0.0
        self.tokens -= e.est_tokens
        self.shorts -= 0 if e.long else 1
        return e

    def get(self, session: str) -> QueueEntry | None:
        cls = self._where.get(session)
        return None if cls is None else self._classes[cls].index.get(session)

    def __len__(self) -> int:
        return len(self._where)

    def only(self) -> QueueEntry:
        """The one waiting session (the caller knows exactly one waits)."""
        session, cls = next(iter(self._where.items()))
        e = self._classes[cls].index.get(session)
        assert e is not None
        return e

    def __contains__(self, session: object) -> bool:
        return session in self._where

    def classes(self) -> list[str]:
        """Classes with sessions waiting, first admitted first."""
        return list(self._classes)

    def waiting(self, cls: str) -> int:
        c = self._classes.get(cls)
        return 0 if c is None else len(c.index)

    def index(self, cls: str) -> OrderIndex:
        return self._classes[cls].index

    # -- across classes -----------------------------------------------------------------------
    def due(self, now: float) -> list[QueueEntry]:
        return [e for c in self._classes.values() for e in c.index.due(now)]

    # Bypasses count within a tenant's lane: a tenant's turn is no bypass of another's sessions
    # (counted across tenants, the sessions of a tenant over its share would all turn urgent).
    def bypasses(self, e: QueueEntry) -> int:
        c = self._classes.get(lane_of(e))
        lane = None if c is None else c.tenants.get(e.tenant)
        return 0 if lane is None else lane.bypasses(e)

    def note_admitted(self, entries: list[QueueEntry]) -> None:
        """Record admissions (after discarding them) in their lanes' bypass counts."""
        by_lane: dict[tuple[str, str], list[QueueEntry]] = {}
        for e in entries:
            by_lane.setdefault((lane_of(e), e.tenant), []).append(e)
        for (cls, tenant), some in by_lane.items():
            c = self._classes.get(cls)
            lane = None if c is None else c.tenants.get(tenant)
            if lane is not None:  # an emptied lane has nobody left to bypass
                lane.note_admitted(some)


    def smallest_tokens(self) -> float:
        return min((c.index.smallest_tokens() for c in self._classes.values()),
                   default=float("inf"))

    def oldest(self) -> QueueEntry | None:
        """The oldest session of the first class that has any waiting."""
        for c in self._classes.values():
            return next(iter(c.index.ordered_by_arrival()), None)
        return None

    def fair(self, cls: str, mode: OrderMode, tags: dict[str, float],
             cost: Callable[[QueueEntry], float], urgency: Urgency) -> FairMerge:
        """The class's sessions in fair order: see :class:`FairMerge`."""
        c = self._classes.get(cls)
        lanes = {} if c is None else c.tenants
        total = self.tenant_weights
        return FairMerge({t: _lane(lane, mode, urgency, self._tenant_weight(t) / total)
                          for t, lane in lanes.items()}, tags, cost)


@dataclass(frozen=True, slots=True)
class Urgency:
    """What decides which sessions of a lane are urgent (``OrderIndex.urgent``)."""

    now: float
    margin_s: float
    max_bypass: int
    rate: float | None
    """Admissions per second, all tenants together; a lane counts on its weighted share."""


def _lane(lane: OrderIndex, mode: OrderMode, u: Urgency,
          share: float) -> Iterator[tuple[QueueEntry, bool]]:
    # A tenant's urgent sessions first (deadline order, its share of the admission rate), then
    # the rest in the mode's order; the flag says which is which.
    rate = None if u.rate is None else u.rate * share
    seen: set[int] = set()
    for e in lane.urgent(u.now, u.margin_s, u.max_bypass, rate):
        seen.add(e.seq)
        yield e, True
    for e in lane.in_mode(mode, seen):
        yield e, False


class FairMerge:
    """A class's sessions, tenant by tenant in order of their virtual token counters, each as
    ``(entry, urgent)``. Urgency orders a tenant's own sessions, never one tenant before
    another: a tenant that cannot drain its backlog at its share misses its own deadlines.

    ``tags`` is the pass's working copy of the counters; :meth:`admitted` raises one.
    :meth:`drop` leaves a tenant out for the rest of the walk (nothing of it fits)."""

    def __init__(self, lanes: dict[str, Iterator[tuple[QueueEntry, bool]]],
                 tags: dict[str, float],
                 cost: Callable[[QueueEntry], float]) -> None:
        self._lanes = lanes
        self._tags = tags
        self._cost = cost
        self._heap = [(tags.get(t, 0.0), t) for t in sorted(lanes)]
        heapq.heapify(self._heap)
        self._dropped: set[str] = set()

    def __iter__(self) -> Iterator[tuple[QueueEntry, bool]]:
        while self._heap:
            _, t = heapq.heappop(self._heap)
            if t in self._dropped:
                continue
            got = next(self._lanes[t], None)
            if got is None:
                continue
            yield got
            if t not in self._dropped:
                heapq.heappush(self._heap, (self._tags.get(t, 0.0), t))

    def admitted(self, e: QueueEntry) -> None:
        self._tags[e.tenant] = self._tags.get(e.tenant, 0.0) + self._cost(e)

    def drop(self, tenant: str) -> None:
        self._dropped.add(tenant)
