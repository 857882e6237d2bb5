"""The admission core's part of the state document, built from the core alone.

The gateway adds what its shell and store know (the limit the store enforces, the store's
leases, the admissions waiting for its confirmation); the simulator writes it as it is, so
that the state snapshots of a simulated and of a live run read alike.

Pure: no I/O; ``now`` is a parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from marsproxy.aimd.admission import AdmissionCore
from marsproxy.aimd.controller import NO_CEILING
from marsproxy.telemetry.state import (
    AdmissionCoreQueueState,
    AdmissionCoreState,
    AdmissionCoreWorkerState,
    AdmissionWorkerState,
    finite,
)

SHOWN_IDS = 50  # session ids listed per worker and in the queue order


def core_state(
    core: AdmissionCore, now: float, show_id: Callable[[str], str] = str
) -> AdmissionCoreState:
    """Windows, caps, the fit and the queue of ``core`` at ``now``; ``show_id`` maps a session
    id to how it is shown (the gateway drops the tenant scope)."""
    q = core.queue
    queue: AdmissionCoreQueueState = {
        "length": len(q), "mode": str(q.mode),
        "order": [show_id(s) for s, i in q.positions(now) if i < SHOWN_IDS],
        "admission_rate_per_s": finite(q.admission_rate(now)),
        "retry_after_s": q.retry_after(now),
    }
    return {
        "peak_growth": core.peaks.growth(),
        "session_lifetime_s": finite(core.overlaps.lifetime_s),
        "returns": {t: list(r) for t, r in core.sessions.returns.rates().items()},
        "workers": {w: _worker(core, w, now, show_id) for w in core.controllers},
        "queue": queue,
    }


def _worker(
    core: AdmissionCore, w: str, now: float, show_id: Callable[[str], str]
) -> AdmissionCoreWorkerState:
    c = core.controllers[w]
    return {
        "window": c.window, "effective_limit": c.effective_limit,
        "kv_cap": c.kv_cap, "cpu_cap": c.cpu_cap, "kv_overloaded": c.kv_overloaded,
        "cpu_overloaded": c.cpu_overloaded, "stale": c.stale,
        "budget_blocks": core.budget(w), "freed_blocks": core.freed_blocks(w),
        "peak_room_blocks": core.peak_room(w),
        "peak_overlap": core.overlaps.overlap(w), "peak_overcommit": core.peak_factor(w),
        "reprefill_s": core.reprefill_s(w),
        "idle_s": core.idle_s(now, w), "admitted": core.sessions.admitted_on(w),
        "held": core.sessions.load_on(w),
        "sessions": [show_id(k) for k in core.sessions.sessions_on(w)[:SHOWN_IDS]],
    }


def binding_cap(window: int, kv_cap: int, cpu_cap: int, effective_limit: int) -> str:
    """Which bound sets the effective limit: the window (only while the worker is overloaded;
    on a tie with a cap, the window), the KV cap, the CPU cap, ``window_max``, or ``none`` (no
    count bound: the KV fit alone decides)."""
    if effective_limit >= NO_CEILING:
        return "none"
    if effective_limit == window and window <= min(kv_cap, cpu_cap):
        return "window"
    if effective_limit == min(kv_cap, cpu_cap):
        return "kv_cap" if kv_cap <= cpu_cap else "cpu_cap"
    return "window_max"


def queue_why(workers: Mapping[str, AdmissionWorkerState], waiting: int,
              need_blocks: Mapping[str, int] | None = None) -> str:
    """Why ``waiting`` sessions wait: per worker, what keeps it from taking the next one;
    ``need_blocks``: the smallest waiting first prompt in that worker's blocks (a KV budget
    below it admits none of them)."""
    if waiting == 0:
        return ""
    parts: list[str] = []
    need_blocks = need_blocks or {}
    for name, w in workers.items():
        budget, need = w["budget_blocks"], need_blocks.get(name, 0)
        binds = w["binds"].replace("_", " ")
        if w["stale"]:
            parts.append(f"{name}: stale pressure, nothing placed (fail closed)")
        elif w["held"] >= w["effective_limit"]:
            parts.append(f"{name}: full {w['held']}/{w['effective_limit']} ({binds})")
        elif w["admitted_store"] >= w["limit"]:
            parts.append(f"{name}: full {w['admitted_store']}/{w['limit']} ({binds})")
        elif w["peak_room_blocks"] is not None and w["peak_room_blocks"] <= 0:
            parts.append(f"{name}: no KV room for another forecast peak")
        elif budget is not None and budget < need:
            parts.append(f"{name}: KV room for a first prompt of {budget} blocks, the smallest"
                         f" waiting has {need}")
        elif w["limit"] >= NO_CEILING:
            parts.append(f"{name}: room (next pass)")
        else:
            parts.append(f"{name}: room for {w['limit'] - w['admitted_store']} (next pass)")
    return "; ".join(parts)
