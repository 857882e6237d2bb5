"""The scheduler core's values: a worker's facts and mode, a continuation's ticket, what a call's
end and a tick return, and the warm-resume accounting."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from marsproxy.sched.ledger import Reservation
from marsproxy.sched.retention import RetentionOutcome

Mode = Literal["priority", "gated"]
"""How a worker orders continuations: the engine by the body's ``priority``, or the proxy."""


@dataclass(frozen=True, slots=True)
class WorkerFacts:
    """What the shell knows about a worker now (from config and the latest scrape)."""

    max_num_seqs: int | None = None
    total_blocks: int | None = None
    block_size: int | None = None
    prefill_tokens_per_s: float | None = None
    kv_usage: float | None = None


@dataclass(slots=True)
class Ticket:
    """One continuation on its way to (or at) a worker."""

    call: int
    session: str
    worker: str
    level: int | None  # las level at arrival (None: a policy without levels)
    priority: int | None  # order key; the vLLM body value in priority mode (lower first)
    retain_s: float | None  # the retention hint sent upstream (provisional, at dispatch)
    warm: bool  # its prefix was retained when it arrived
    prompt_tokens: int
    uncached_tokens: int
    blocks: int  # KV blocks it is expected to hold while running
    arrived: float
    gated: bool  # it waits in (or went through) the proxy's dispatch queue
    released_at: float | None = None
    bypassed: int = 0  # how often smaller ones passed it (backfill)

    @property
    def dispatched(self) -> bool:
        return self.released_at is not None

    def waited_s(self) -> float:
        return 0.0 if self.released_at is None else max(0.0, self.released_at - self.arrived)


@dataclass(frozen=True, slots=True)
class EndResult:
    ticket: Ticket | None  # None: the call was unknown (already ended)
    retention: RetentionOutcome | None  # None: no decision (failed, final, or not retainable)
    context_tokens: int
    prefill_tokens_per_s: float | None
    resume: Literal["warm", "cold"] | None  # None: not a resume (first call of the session)


@dataclass(frozen=True, slots=True)
class TickResult:
    expired: list[Reservation]
    dropped: list[Reservation]


@dataclass(slots=True)
class ResumeStats:
    """Warm-resume accounting: continuations that came back after a tool phase."""

    warm: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    cold: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    cached_tokens: int = 0
    context_tokens: int = 0

    @property
    def resumes(self) -> int:
        return sum(self.warm.values()) + sum(self.cold.values())

    @property
    def hit_rate(self) -> float | None:
        """Warm resumes / resumes; None before the first resume."""
        n = self.resumes
        return None if n == 0 else sum(self.warm.values()) / n


@dataclass(slots=True)
class SessionRecord:
    """What the scheduler core keeps of a session between its calls."""

    ordinal: int  # arrival order of the session (session_fcfs)
    context_tokens: int = 0  # prompt + completion of its last call
    output_tokens: int = 0  # completion of its last call
    calls: int = 0
    level: int | None = None  # of its latest call (shown in the state document)
    worker: str | None = None  # of its latest call
    call_s: float | None = None  # engine time of its latest call that went well
    dormant_since: float | None = None  # its latest call ended and it goes on (tool phase)
