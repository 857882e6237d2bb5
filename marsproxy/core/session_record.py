"""One admitted or waiting session as the admission plane keeps it: its state, phase, why it
ended, and the record the lifecycle (``core/lifecycle.py``) moves through those states.

Pure code: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class SessionState(StrEnum):
    QUEUED = "queued"
    ADMITTED = "admitted"
    ENDED = "ended"


class Phase(StrEnum):
    LLM = "llm"
    TOOL = "tool"


class EndReason(StrEnum):
    FINAL = "final"
    ANSWERED = "answered"
    """Its reply called no tool, from a key whose replies call tools (``core/answers.py``)."""
    DELETED = "deleted"
    """Ended on purpose (``DELETE``): wherever it lives, on any replica."""
    EVICTED = "evicted"
    """The gateway's session table let it go (over its cap)."""
    IDLE_TIMEOUT = "idle_timeout"
    QUEUE_DEADLINE = "queue_deadline"
    ABANDONED = "abandoned"
    """The client of a waiting session went away before it was admitted."""
    MOVED = "moved"
    """Another replica took the session over (its lease moved there); it lives on there."""


# Endings after which a session's largest context is its peak (the growth forecast learns it)
# and its life a lifetime (the overlap's pace).
RAN_ITS_COURSE = frozenset({EndReason.FINAL, EndReason.ANSWERED, EndReason.IDLE_TIMEOUT,
                            EndReason.DELETED})


class LifecycleError(ValueError):
    """A transition the lifecycle does not allow (a bug in the caller)."""


@dataclass(slots=True)
class SessionRecord:
    key: str
    tenant: str
    state: SessionState
    queued_at: float
    est_tokens: int = 0
    long: bool = False
    phase: Phase = Phase.LLM
    worker: str | None = None
    admitted_at: float | None = None
    last_active: float = 0.0
    in_flight: int = 0
    """Requests of this session being served or waiting for admission."""
    final: bool = False
    """Its last request has arrived: it ends when that request's response ends."""
    idle_timeout_s: float = 0.0
    turns: int = 0
    end_reason: EndReason | None = None
    idle_key: tuple[float, str] | None = None
    """Its place in the lifecycle's idle index while it is idle."""
    hold_key: tuple[float, str] | None = None
    """Its place in the KV-hold index while it is dormant and its KV budget (or slot) held."""
    slot_until: float | None = None
    """Past a KV hold cut short by a cheap re-prefill, it keeps its slot (load) until then."""
    kv_held: bool = True
    """Whether its forecast counts in the KV fit (false once dormant past its hold)."""
    first_gap: bool = False
    """Dormant after its first call, not back yet: its tenant's return tally waits for it."""
    watched: bool = False
    """It holds a slot but no KV room: a first gap of a tenant whose sessions seldom come back,
    a parent waiting on its children, or one past a KV hold cut short (``lapsed``)."""
    lapsed: bool = False
    """Watched past a KV hold cut short (its slot until ``slot_until``): quiet longer than its
    tools usually take, it counts in placement only, not in the window or the caps."""
    incarnation: int = 0
    """Which session of its key this is (a key names a new one after its session ended): a
    call is charged to the incarnation it started in (``ControlPlane.call_end``)."""

    def idle_deadline(self) -> float | None:
        """When an idle session times out; ``None`` while a request is in flight."""
        if self.state is not SessionState.ADMITTED or self.in_flight > 0:
            return None
        return self.last_active + self.idle_timeout_s
