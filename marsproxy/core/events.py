"""Typed, timestamped events of the unified information stream.

Every sample and every decision is one of these. They are plain frozen dataclasses so that pure
code can produce them and any sink can serialise them with :func:`event_to_dict`. ``ts`` is the
wall-clock time (seconds since the epoch) given by whoever publishes; ``session`` is the
tenant-scoped session key (never exported as a Prometheus label).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class Event:
    type: ClassVar[str] = "event"
    ts: float
    session: str | None = None
    worker: str | None = None


@dataclass(frozen=True, slots=True)
class SessionQueued(Event):
    type: ClassVar[str] = "session_queued"
    est_prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SessionAdmitted(Event):
    type: ClassVar[str] = "session_admitted"
    wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Dispatch(Event):
    type: ClassVar[str] = "dispatch"
    route: str = ""
    turn: int = 0
    level: int | None = None
    hint: str = ""
    priority: int | None = None
    mode: str = ""
    uncached_tokens: int | None = None
    queued_s: float = 0.0


@dataclass(frozen=True, slots=True)
class FirstToken(Event):
    type: ClassVar[str] = "first_token"
    ttft_s: float = 0.0


@dataclass(frozen=True, slots=True)
class LlmEnd(Event):
    type: ClassVar[str] = "llm_end"
    status: int = 200
    latency_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ToolStart(Event):
    type: ClassVar[str] = "tool_start"
    tool: str = ""
    inferred: bool = False
    queue_wait_s: float | None = None


@dataclass(frozen=True, slots=True)
class ToolEnd(Event):
    type: ClassVar[str] = "tool_end"
    tool: str = ""
    inferred: bool = False
    duration_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RetentionDecision(Event):
    type: ClassVar[str] = "retention_decision"
    retain: bool = False
    reprefill_s: float = 0.0
    predicted_tool_s: float = 0.0
    blocks: int = 0
    ttl_s: float = 0.0
    reason: str = ""
    context_tokens: int = 0
    prefill_tokens_per_s: float | None = None
    policy: str = ""


@dataclass(frozen=True, slots=True)
class RetentionVerified(Event):
    """A retained session resumed: how much of its prefix its worker still held (KV events)."""

    type: ClassVar[str] = "retention_verified"
    outcome: str = ""
    """``kept``, ``partly_kept`` or ``lost``."""
    reserved_tokens: int = 0
    """The prefix the ledger retained for it (its blocks, in tokens)."""
    resident_tokens: int = 0
    """Leading tokens of the resumed call's prompt the worker's KV index found resident."""


@dataclass(frozen=True, slots=True)
class RetentionCorrected(Event):
    """The engine evicted part of a retained prefix: the ledger keeps only what is left."""

    type: ClassVar[str] = "retention_corrected"
    reserved_blocks: int = 0
    resident_blocks: int = 0


@dataclass(frozen=True, slots=True)
class WindowChange(Event):
    type: ClassVar[str] = "window_change"
    old: float = 0.0
    new: float = 0.0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PressureSample(Event):
    type: ClassVar[str] = "pressure_sample"
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    stale: bool = False
    cpu_some_avg10: float | None = None
    tools_in_flight: int = 0
    backlog_ratio: float = 0.0


@dataclass(frozen=True, slots=True)
class Rejected(Event):
    type: ClassVar[str] = "rejected"
    reason: str = ""
    status: int = 0


@dataclass(frozen=True, slots=True)
class SessionEnd(Event):
    type: ClassVar[str] = "session_end"
    reason: str = ""
    turns: int = 0
    duration_s: float = 0.0


EVENT_TYPES: dict[str, type[Event]] = {
    cls.type: cls
    for cls in (
        SessionQueued,
        SessionAdmitted,
        Dispatch,
        FirstToken,
        LlmEnd,
        ToolStart,
        ToolEnd,
        RetentionDecision,
        RetentionVerified,
        RetentionCorrected,
        WindowChange,
        PressureSample,
        Rejected,
        SessionEnd,
    )
}


def event_to_dict(ev: Event) -> dict[str, Any]:
    """``{"type": ..., "ts": ..., ...fields}`` — the wire form of every sink."""
    out: dict[str, Any] = {"type": ev.type}
    for f in dataclasses.fields(ev):
        out[f.name] = getattr(ev, f.name)
    return out
