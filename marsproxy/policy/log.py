"""The plane's decisions as a log: what the parity test compares between the two drivers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Entry:
    t: float
    kind: str
    """``admit`` (worker), ``level`` (worker, level, priority, gated), ``retain`` (retain,
    blocks), ``window`` (worker, limit), ``refuse`` (reason), ``end`` (reason)."""
    session: str
    detail: tuple[Any, ...] = ()


@dataclass(slots=True)
class DecisionLog:
    entries: list[Entry] = field(default_factory=list)

    def add(self, t: float, kind: str, session: str, *detail: Any) -> None:
        self.entries.append(Entry(round(t, 9), kind, session, detail))
