"""What the admission shell answers a request, and what it keeps per pending session."""

from __future__ import annotations

from dataclasses import dataclass

from marsproxy.core.session_record import EndReason

# The gateway session table's reasons for forgetting a session, as the core's end reasons.
END_REASONS: dict[str, EndReason] = {
    "final": EndReason.FINAL,
    "idle": EndReason.IDLE_TIMEOUT,
    "evicted": EndReason.EVICTED,
    "deleted": EndReason.DELETED,
}

# What a 429 from the admission queue says (the reason is its code and x-marsproxy-reason).
QUEUE_REFUSALS = {
    "queue_full": "admission queue full; retry later",
    "class_over_share": "this service class holds its share of the admission queue while"
    " others wait; retry later",
    "tenant_over_share": "this API key holds its share of the admission queue while others"
    " wait; retry later",
}


@dataclass(frozen=True, slots=True)
class Granted:
    """Go on: the session holds a slot on ``worker``."""

    worker: str
    """Worker label."""
    waited_s: float
    incarnation: int | None
    """The session the request joined (``Answer.incarnation``): its call's end goes there."""


@dataclass(frozen=True, slots=True)
class Refused:
    """Answer the request with this error (``code`` names the reason)."""

    status: int
    code: str
    retry_after_s: int
    message: str


Verdict = Granted | Refused


@dataclass(slots=True)
class Pending:
    """Admitted by the local core, not yet confirmed by the store."""

    worker: str
    since: float  # monotonic arrival of its first request
    arrival_ms: int  # wall-clock arrival: its score in the global queue
    idle: bool = False
    """An idle admission: confirmed against the idle limit, on this worker only."""
