"""The waiting sessions, indexed for every admission order at once.

A control tick must stay cheap with ten thousand sessions waiting, so nothing is sorted per
tick: each entry sits in sorted lists for arrival, shortest-first and deadline order, kept by
bisection as entries come and go, and a pass walks only as far as it admits.

Bypasses are counted without touching waiting entries: the sessions that bypassed an entry are
exactly the admitted ones that arrived after it (a higher sequence number), so one sorted list
of admitted sequence numbers answers for all. The count falls with the sequence number, so the
entries promoted for too many bypasses are always a prefix of the arrival order, as are those
near their deadline (for a fixed deadline offset).

Pure code: no I/O; ``now`` is a parameter.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum


class OrderMode(StrEnum):
    ARRIVAL = "arrival"
    SHORTEST_FIRST = "shortest_first"


@dataclass(slots=True)
class QueueEntry:
    """One waiting session."""

    session: str
    tenant: str
    arrival: float
    est_tokens: int
    deadline: float
    seq: int = 0
    """Arrival tie-breaker, set by the queue."""
    long: bool = False
    """First prompt above ``long_prompt_tokens``; set by the queue."""
    cls: str = ""
    """Service class (``admission.classes``); empty: the default class, set by the queue."""
    child: bool = False
    """A child of an admitted parent session (agent trees): it waits in the children's lane,
    ahead of every class."""
    grows: bool = True
    """Forecast to grow by the learnt growth (false: its tenant's sessions are known not to
    return, ``core/returns.py``): not fitted (``Room.budget_of``)."""
    bound: str | None = None
    """The only worker it may go to: it continues a reply that worker keeps (a Responses
    ``previous_response_id``), any other would not know it."""


def _deadline_key(e: QueueEntry) -> tuple[float, float, int]:
    return (e.deadline, e.arrival, e.seq)


def _remove(lst: list[tuple[float, ...]], key: tuple[float, ...]) -> None:
    i = bisect.bisect_left(lst, key)
    if i < len(lst) and lst[i] == key:
        del lst[i]


class OrderIndex:
    def __init__(self) -> None:
        self._by_seq: dict[int, QueueEntry] = {}  # insertion order is seq order
        self._by_session: dict[str, QueueEntry] = {}
        self._arrival: list[tuple[float, ...]] = []  # (arrival, seq)
        self._short: list[tuple[float, ...]] = []  # (tokens, arrival, seq)
        self._deadline: list[tuple[float, ...]] = []  # (deadline, arrival, seq)
        self._admitted_seqs: list[int] = []
        self.tokens = 0
        self.shorts = 0

    # -- membership ---------------------------------------------------------------------------
    def add(self, e: QueueEntry) -> None:
        self._by_seq[e.seq] = e
        self._by_session[e.session] = e
        bisect.insort(self._arrival, (e.arrival, e.seq))
        bisect.insort(self._short, (e.est_tokens, e.arrival, e.seq))
        bisect.insort(self._deadline, (e.deadline, e.arrival, e.seq))
        self.tokens += e.est_tokens
        self.shorts += 0 if e.long else 1

    def discard(self, session: str) -> QueueEntry | None:
        e = self._by_session.pop(session, None)
        if e is None:
            return None
        del self._by_seq[e.seq]
        _remove(self._arrival, (e.arrival, e.seq))
        _remove(self._short, (e.est_tokens, e.arrival, e.seq))
        _remove(self._deadline, (e.deadline, e.arrival, e.seq))
        self.tokens -= e.est_tokens
        self.shorts -= 0 if e.long else 1
        return e

    def get(self, session: str) -> QueueEntry | None:
        return self._by_session.get(session)

    def __len__(self) -> int:
        return len(self._by_session)

    def __contains__(self, session: object) -> bool:
        return session in self._by_session

    def due(self, now: float) -> list[QueueEntry]:
        """Entries whose deadline is at or before ``now``, earliest first."""
        end = bisect.bisect_right(self._deadline, (now, float("inf"), float("inf")))
        return [self._by_seq[int(k[2])] for k in self._deadline[:end]]

    # -- bypasses -----------------------------------------------------------------------------
    def note_admitted(self, entries: Iterable[QueueEntry]) -> None:
        """Record admissions (after discarding them) for the bypass counts of those left."""
        for e in entries:
            bisect.insort(self._admitted_seqs, e.seq)
        # Admissions older than every waiting entry bypassed nobody still waiting.
        oldest = next(iter(self._by_seq), None)
        if oldest is None:
            self._admitted_seqs.clear()
        else:
            del self._admitted_seqs[: bisect.bisect_left(self._admitted_seqs, oldest)]

    def bypasses(self, e: QueueEntry) -> int:
        """Later arrivals admitted while ``e`` waited."""
        return len(self._admitted_seqs) - bisect.bisect_right(self._admitted_seqs, e.seq)

    def smallest_tokens(self) -> float:
        """Estimated tokens of the smallest waiting entry (infinite when none waits)."""
        return self._short[0][0] if self._short else float("inf")

    def ordered_by_arrival(self) -> Iterator[QueueEntry]:
        return (self._by_seq[int(k[-1])] for k in self._arrival)

    # -- order --------------------------------------------------------------------------------
    def promoted(self, max_bypass: int) -> list[QueueEntry]:
        """Entries bypassed ``max_bypass`` times, in deadline order."""
        return sorted(
            itertools.takewhile(lambda e: self.bypasses(e) >= max_bypass, self._by_seq.values()),
            key=_deadline_key,
        )

    def urgent(
        self, now: float, margin_s: float, max_bypass: int, rate: float | None = None
    ) -> Iterator[QueueEntry]:
        """Entries that must go first, in deadline order; lazy, so a pass that stops early
        pays only for what it looked at.

        That is the *critical prefix* of the deadline order (every entry up to the last one
        whose slack, less ``margin_s``, no longer covers admitting it and all before it at
        ``rate`` per second), plus the entries bypassed ``max_bypass`` times.
        """
        promoted = self.promoted(max_bypass)
        seen: set[int] = set()
        for e in heapq.merge(self._critical(now, margin_s, rate), promoted, key=_deadline_key):
            if e.seq not in seen:
                seen.add(e.seq)
                yield e

    def _critical(self, now: float, margin_s: float, rate: float | None) -> Iterator[QueueEntry]:
        # Seconds per admission: unknown rate → none needed (only the margin counts); a
        # stalled queue → infinite, so everything is critical and the order is pure EDF.
        per = 0.0 if rate is None else (1.0 / rate if rate > 0 else float("inf"))
        dl = self._deadline
        # Past this slack no entry can be critical: not even all of them ahead would fill it.
        hopeless = len(dl) * per
        last = -1  # index of the last entry known to be critical
        for i, k in enumerate(dl):
            if i > last:
                j = i
                while j < len(dl):
                    slack = dl[j][0] - now - margin_s
                    if slack <= (j + 1) * per:
                        break
                    if slack > hopeless:
                        return
                    j += 1
                else:
                    return
                last = j
            yield self._by_seq[int(k[2])]

    def in_mode(self, mode: OrderMode, skip: set[int]) -> Iterator[QueueEntry]:
        """Entries in ``mode`` order, leaving out ``skip``."""
        keys = self._short if mode is OrderMode.SHORTEST_FIRST else self._arrival
        for k in keys:
            seq = int(k[-1])
            if seq not in skip:
                yield self._by_seq[seq]

    def ordered(self, now: float, mode: OrderMode, margin_s: float, max_bypass: int,
                rate: float | None = None) -> list[QueueEntry]:
        """Every entry, first to be admitted first."""
        head = list(self.urgent(now, margin_s, max_bypass, rate))
        return head + list(self.in_mode(mode, {e.seq for e in head}))
