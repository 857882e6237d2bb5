"""What the control plane hands back to its drivers: a session's phase, the outcome to carry
out, the answer to a request, the account of a call's end.

Pure code: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from marsproxy.aimd.admission import DecisionKind, Expiry
from marsproxy.core.events import Event
from marsproxy.core.session_record import EndReason
from marsproxy.sched.ledger import Reservation
from marsproxy.sched.tickets import EndResult, Ticket


class Phase(StrEnum):
    WAITING = "waiting"
    PENDING = "pending"
    IN_CALL = "in_call"
    DORMANT = "dormant"
    ENDED = "ended"


@dataclass(slots=True)
class Pending:
    """Admitted here, waiting for the window store to confirm its slot."""

    worker: str
    since: float
    """Arrival of its first request (control clock): its queue deadline and store score."""
    idle: bool = False
    """An idle admission: confirmed against the idle limit, on this worker only."""
    tenant: str = ""
    cls: str = ""
    """Its service class."""
    child: bool = False
    """A child of an admitted parent (the children's lane)."""
    est_tokens: int = 0
    """Its estimated first prompt (what its admission charges its tenant)."""


@dataclass(frozen=True, slots=True)
class Ended:
    session: str
    reason: EndReason
    worker: str | None
    """It held a confirmed slot on this worker: release it."""
    pending: Pending | None
    """It was waiting for the store: withdraw the ask (and any slot granted unseen)."""


@dataclass(slots=True)
class Outcome:
    """What the driver carries out, in this order."""

    proposed: list[str] = field(default_factory=list)
    """Sessions now pending: ask the store to confirm them (oldest first)."""
    expired: list[Expiry] = field(default_factory=list)
    """Waiting requests to answer with an error."""
    ended: list[Ended] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    returned: list[Reservation] = field(default_factory=list)
    """KV reservations given back because their session ended."""

    def __bool__(self) -> bool:
        return bool(self.proposed or self.expired or self.ended or self.events)

    def extend(self, more: Outcome) -> None:
        self.proposed += more.proposed
        self.expired += more.expired
        self.ended += more.ended
        self.events += more.events
        self.returned += more.returned


@dataclass(frozen=True, slots=True)
class Answer:
    """The plane's answer to a request."""

    kind: DecisionKind
    worker: str | None = None
    status: int = 0
    retry_after_s: int | None = None
    reason: str = ""
    outcome: Outcome = field(default_factory=Outcome)
    incarnation: int | None = None
    """The session the request joined (``SessionRecord.incarnation``), for the call's end
    (``ControlPlane.call_end``); ``None``: refused."""


@dataclass(frozen=True, slots=True)
class CallEnd:
    result: EndResult | None
    """The scheduler's account of the call (``None``: nothing was scheduled)."""
    released: list[Ticket]
    """Gated calls the freed room lets go now."""
    outcome: Outcome
    answered: bool = False
    """Its reply answered without a tool call (``core/answers.py``): the session ended."""
