"""The shape of ``GET /mars/v1/state``: one JSON document with every pressure the proxy sees.

Typed here (pure, no I/O) so that the gateway that builds it, the Prometheus collector that
exports it and ``marsproxy status`` that renders it agree on one schema. Numbers that are not
known (no sample yet, no such metric on the server) are ``None`` (JSON ``null``), never NaN.
"""

from __future__ import annotations

import math
from typing import Literal, NotRequired, TypedDict

from marsproxy.telemetry.kv_index import KVIndexWorkerState

SessionState = Literal["llm", "tool", "idle"]
SESSION_STATES: tuple[SessionState, ...] = ("llm", "tool", "idle")


class GpuState(TypedDict):
    available: bool
    memory_used_frac: float | None
    utilization_pct: float | None


class QueuedState(TypedDict):
    session: str
    level: int | None
    priority: int | None
    waited_s: float
    blocks: int
    bypassed: int


class ReservationState(TypedDict):
    session: str
    blocks: int
    level: int
    expires_in_s: float


class WorkerSchedState(TypedDict):
    mode: str
    """priority: levels go in the body's priority; gated: the proxy's dispatch queue orders;
    off: priority_policy off (no levels, nothing held)."""
    mode_reason: str
    in_flight: int
    cap: int
    running_blocks: int
    usable_blocks: int | None
    dispatched_total: int
    queue_length: int
    queue: list[QueuedState]
    """First 50 held continuations, next to go first."""
    retained_blocks: int
    reservations: list[ReservationState]
    """First 50 KV-ledger reservations, oldest first."""


class ResumesState(TypedDict):
    warm: int
    cold: int
    warm_retained: int
    """Warm resumes whose prefix the ledger had retained."""
    hit_rate: float | None
    cached_tokens: int
    context_tokens: int


class SchedState(TypedDict):
    priority_policy: str
    retention_policy: str
    hint_encoder: str
    levels_total: dict[str, int]
    backfilled_total: int
    resumes: ResumesState


class WorkerState(TypedDict):
    name: str
    url: str
    healthy: bool
    stale: bool
    age_s: float | None
    kv_usage: float | None
    running: int | None
    waiting: int | None
    preemptions_per_s: float | None
    prefix_cache_hit_rate: float | None
    prefill_tokens_per_s: float | None
    block_size: int | None
    num_gpu_blocks: int | None
    max_model_len: int | None
    """The longest context the worker serves (``/v1/models``; caps admission's forecasts)."""
    scrape_errors: int
    scrape_period_s: float | None
    """The scrape period now: ``probes.vllm.period_s``, or ``idle_period_s`` while idle."""
    sessions: int
    requests_in_flight: int
    gpu: GpuState
    scheduler: NotRequired[WorkerSchedState]  # always set by the gateway


class CpuState(TypedDict):
    source: str
    psi_some_avg10: float | None
    psi_some_avg60: float | None
    throttled_usec: int | None
    cpu_percent: float | None
    tool_cpus: float


class ToolsState(TypedDict):
    in_flight: int
    backlog_ratio: float
    queue_wait_ema_s: float
    slowdown_ema: float


class SessionDetail(TypedDict):
    id: str
    worker: str
    state: SessionState
    turns: int
    tool: str | None
    since_s: float
    age_s: float
    """Since the session's first request."""
    level: int | None
    """Level of its latest call (``las``; ``None``: no call yet, or a policy without levels)."""
    retained_blocks: int
    """KV blocks the ledger holds for it through its tool phase (0: none)."""
    parent: str | None
    """The session it names as its parent (agent trees; ``None``: a root)."""


class _SessionsBase(TypedDict):
    total: int
    by_state: dict[str, int]
    trees: dict[str, list[str]]
    """Agent trees: each parent with live children → those children (ids); the first 50
    parents by id, 50 children each."""
    linked: int
    """Sessions with a live parent (all of them, shown in ``trees`` or not)."""


class SessionsState(_SessionsBase, total=False):
    details: list[SessionDetail]  # only with ?sessions=1


class EventsState(TypedDict):
    published_total: int
    dropped_total: int
    subscribers: int


class AdmissionCoreWorkerState(TypedDict):
    """What the admission core alone knows of a worker (the simulator's snapshots)."""

    window: int
    effective_limit: int
    """This replica's own limit: min(window, kv_cap, cpu_cap)."""
    kv_cap: int
    cpu_cap: int
    kv_overloaded: bool
    cpu_overloaded: bool
    stale: bool
    budget_blocks: int | None
    freed_blocks: int
    """Of the budget: blocks of calls that ended since the gauge was read (``gauge.py``)."""
    peak_room_blocks: int | None
    """First-prompt blocks the forecast-peak fit leaves (``None``: off or no block counts)."""
    peak_overlap: float
    """Measured share of their forecast peaks that admitted sessions hold at once (1: none
    measured yet)."""
    peak_overcommit: float
    """The factor the forecast-peak fit uses now: peak_overlap_target / peak_overlap, clamped,
    or peak_overcommit_max while a preemption is cheap there (reprefill_s)."""
    reprefill_s: float | None
    """Seconds the worker takes to re-prefill the mean forecast peak of its sessions, at its
    measured prefill speed (``None``: no session held or no speed measured yet)."""
    idle_s: float | None
    """How long the worker has run nothing while its sessions sit in tool phases."""
    admitted: int
    """Sessions this replica's core holds on the worker (pending confirmation included)."""
    held: int
    """Of them, those holding a slot (in a call, or dormant within their KV hold, with or
    without KV room): what the window counts."""
    sessions: list[str]
    """First 50 session ids admitted here."""


class AdmissionWorkerState(AdmissionCoreWorkerState):
    limit: int
    """The limit the store enforces on all leases: the leader's published one, else
    ``effective_limit``, plus this replica's admitted sessions that hold no slot."""
    admitted_store: int
    """Live leases on the worker in the store: all replicas together."""
    binds: str
    """Which bound sets ``effective_limit``: window, kv_cap or cpu_cap."""


class AdmissionCoreQueueState(TypedDict):
    length: int
    mode: str
    order: list[str]
    """First 50 waiting session ids, next to be admitted first."""
    admission_rate_per_s: float | None
    retry_after_s: int


class WaitingState(TypedDict):
    session: str
    waited_s: float
    est_tokens: int
    long: bool
    bypasses: int
    """Later arrivals admitted ahead of it."""
    retry_after_s: int
    """Retry-After the proxy sends this session if it refuses it now (its place in line)."""


class AdmissionQueueState(AdmissionCoreQueueState):
    pending: int
    """Proposed by the core, waiting for the store to confirm (the global queue)."""
    waiting: list[WaitingState]
    """First 50 waiting sessions, next to be admitted first."""
    why: str
    """Why sessions wait: what holds each worker back (empty when none waits)."""


class OverloadMarks(TypedDict):
    """The admission thresholds (``admission.*``) the pressures are compared with."""

    kv_enter: float
    kv_leave: float
    cpu_backlog_enter: float
    cpu_backlog_leave: float
    psi_enter: float
    psi_leave: float


class StoreState(TypedDict):
    backend: str
    mode: str
    up: bool
    is_leader: bool
    live_replicas: int
    failures_total: int


class AdmissionCoreState(TypedDict):
    """The admission core's part of the state: a simulated run's snapshot rows."""

    peak_growth: float
    """G of the forecast-peak fit: the prior, or Σ peak / Σ first prompt of finished sessions."""
    session_lifetime_s: float | None
    """Mean time admitted of recent sessions that ran their course (the overlap's pace)."""
    returns: dict[str, list[int]]
    """Per tenant: [came back, seen] of its latest sessions dormant after their first call, and
    how many are dormant after it now."""
    workers: dict[str, AdmissionCoreWorkerState]
    queue: AdmissionCoreQueueState


class AdmissionState(TypedDict):
    enabled: bool
    peak_growth: float
    session_lifetime_s: float | None
    returns: dict[str, list[int]]
    workers: dict[str, AdmissionWorkerState]
    queue: AdmissionQueueState
    store: StoreState
    marks: OverloadMarks


class StateDoc(TypedDict):
    time: float
    version: str
    workers: list[WorkerState]
    cpu: CpuState
    tools: ToolsState
    sessions: SessionsState
    events: EventsState
    scheduler: NotRequired[SchedState]  # always set by the gateway
    admission: NotRequired[AdmissionState]  # absent when admission.enabled is false
    kv_index: NotRequired[dict[str, KVIndexWorkerState]]  # workers with kv_events only


def finite(x: float | None) -> float | None:
    """``x`` unless it is None, NaN or infinite (JSON has no NaN; the status CLI needs null)."""
    if x is None or not math.isfinite(x):
        return None
    return float(x)
