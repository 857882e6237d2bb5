"""What the admission core answers: a request's decision, the actions a driver carries out."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from marsproxy.aimd.queue import Admission, QueueEntry
from marsproxy.core.events import Event, WindowChange
from marsproxy.core.session_record import EndReason


class DecisionKind(StrEnum):
    ADMITTED = "admitted"
    WAIT = "wait"
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class Expiry:
    """A waiting request that must be answered with an error now."""

    session: str
    status: int
    retry_after_s: int
    reason: str


@dataclass(slots=True)
class Actions:
    admitted: list[Admission] = field(default_factory=list)  # wake: their requests go there
    expired: list[Expiry] = field(default_factory=list)
    ended: list[tuple[str, EndReason]] = field(default_factory=list)
    window_changes: list[WindowChange] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)  # to publish, in order (window too)


@dataclass(frozen=True, slots=True)
class Decision:
    kind: DecisionKind
    worker: str | None = None
    status: int = 0
    retry_after_s: int | None = None
    reason: str = ""
    idle: bool = False  # admitted past the limit onto an idle worker (tuning.idle_admit)
    actions: Actions = field(default_factory=Actions)  # events, others admitted in its pass
    entry: QueueEntry | None = None  # admitted: as which queue entry (tenant, class, lane)
