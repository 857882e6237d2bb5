"""``GET /mars/v1/state``: the state document (schema in :mod:`marsproxy.telemetry.state`).

Built on demand from what the gateway holds now; the Prometheus collector builds the same
document (without session details) at each scrape. Session ids are shown without their tenant
scope; nothing from a request's Authorization header ever appears.
"""

from __future__ import annotations

import time

import marsproxy
from marsproxy.aimd.fit import DEFAULT_BLOCK_SIZE
from marsproxy.aimd.queue import QueueEntry
from marsproxy.config import WorkerConfig
from marsproxy.core.kv import blocks_for_tokens
from marsproxy.gateway.shells.admission import AdmissionShell
from marsproxy.gateway.shells.service import Gateway
from marsproxy.gateway.shells.sessions import unscoped_id
from marsproxy.probes.nvml import GpuPressure
from marsproxy.telemetry.admission_state import SHOWN_IDS, binding_cap, core_state, queue_why
from marsproxy.telemetry.state import (
    SESSION_STATES,
    AdmissionState,
    AdmissionWorkerState,
    CpuState,
    GpuState,
    SchedState,
    SessionDetail,
    SessionsState,
    SessionState,
    StateDoc,
    ToolsState,
    WaitingState,
    WorkerSchedState,
    WorkerState,
    finite,
)


def build_state(
    gw: Gateway, *, details: bool = False, limit: int = 100, offset: int = 0
) -> StateDoc:
    tel = gw.telemetry
    doc: StateDoc = {
        "time": time.time(),
        "version": marsproxy.__version__,
        "workers": [_worker(gw, w) for w in gw.cfg.workers],
        "cpu": _cpu(gw),
        "tools": _tools(gw),
        "sessions": _sessions(gw, details=details, limit=limit, offset=offset),
        "events": {
            "published_total": tel.bus.published_total,
            "dropped_total": tel.bus.dropped_total,
            "subscribers": tel.bus.subscribers,
        },
        "scheduler": _scheduler(gw),
    }
    if gw.admission is not None:
        doc["admission"] = _admission(gw.admission)
    if gw.kv_events is not None:  # the KV index of workers with kv_events (issue 24)
        doc["kv_index"] = gw.kv_events.state()
    return doc


def _admission(adm: AdmissionShell) -> AdmissionState:
    """The core's windows, limits, fit and queue, with what the shell and the store add (ids
    without tenant)."""
    base = core_state(adm.core, adm.now(), unscoped_id)
    workers: dict[str, AdmissionWorkerState] = {
        w: {**v, "limit": adm.limit(w), "admitted_store": adm.store_admitted(w),
            "binds": binding_cap(v["window"], v["kv_cap"], v["cpu_cap"], v["effective_limit"])}
        for w, v in base["workers"].items()
    }
    store, a = adm.store, adm.acfg
    now = adm.now()
    ordered = adm.core.queue.ordered(now)  # once: the waiting list and the why both read it
    waiting = _waiting(adm, ordered, now)
    return {
        "enabled": True,
        "peak_growth": base["peak_growth"],
        "session_lifetime_s": base["session_lifetime_s"],
        "returns": base["returns"],
        "workers": workers,
        "queue": {**base["queue"], "pending": adm.pending, "waiting": waiting,
                  "why": queue_why(workers, base["queue"]["length"] + adm.pending,
                                   _smallest_blocks(adm, ordered))},
        "store": {
            "backend": adm.cfg.store.backend, "mode": store.mode, "up": store.up,
            "is_leader": store.is_leader, "live_replicas": store.live_replicas,
            "failures_total": store.failures_total,
        },
        "marks": {
            "kv_enter": a.tuning.kv_enter, "kv_leave": a.tuning.kv_leave,
            "cpu_backlog_enter": a.tuning.cpu_backlog_enter,
            "cpu_backlog_leave": a.tuning.cpu_backlog_leave,
            "psi_enter": a.tuning.psi_enter, "psi_leave": a.tuning.psi_leave,
        },
    }


def _smallest_blocks(adm: AdmissionShell, ordered: list[QueueEntry]) -> dict[str, int]:
    """The smallest waiting first prompt in each worker's blocks (none waits: empty)."""
    if not ordered:
        return {}
    smallest = min(e.est_tokens for e in ordered)
    return {w: blocks_for_tokens(smallest, o.block_size or DEFAULT_BLOCK_SIZE)
            for w, o in adm.plane.observed.items()}


def _waiting(adm: AdmissionShell, ordered: list[QueueEntry], now: float) -> list[WaitingState]:
    """Who waits, for how long, and the Retry-After each would get (by its place in line)."""
    q = adm.core.queue
    return [
        {"session": unscoped_id(e.session), "waited_s": max(0.0, now - e.arrival),
         "est_tokens": e.est_tokens, "long": e.long, "bypasses": q.bypasses(e.session),
         "retry_after_s": q.retry_after(now, ahead=i + 1)}
        for i, e in enumerate(ordered[:SHOWN_IDS])
    ]


def _worker(gw: Gateway, w: WorkerConfig) -> WorkerState:
    p = gw.telemetry.worker_pressure(w.label)
    m = None if p is None else p.metrics
    r = None if p is None else p.rates
    gpus = gw.telemetry.gpu.latest
    return {
        "name": w.label,
        "url": w.url,
        "healthy": gw.health.is_healthy(w.url),
        # Before the first scrape nothing is known: stale, like a worker that stopped answering.
        "stale": True if p is None else p.stale,
        "age_s": None if p is None else finite(p.age_s),
        "kv_usage": None if m is None else finite(m.kv_usage),
        "running": None if m is None else m.running,
        "waiting": None if m is None else m.waiting,
        "preemptions_per_s": None if r is None else finite(r.preemptions_per_s),
        "prefix_cache_hit_rate": None if r is None else finite(r.prefix_cache_hit_rate),
        "prefill_tokens_per_s": None if r is None else finite(r.prefill_tokens_per_s),
        "block_size": None if m is None else m.block_size,
        "num_gpu_blocks": None if m is None else m.num_gpu_blocks,
        "max_model_len": None if p is None else p.max_model_len,
        "scrape_errors": 0 if p is None else p.scrape_errors,
        "scrape_period_s": gw.telemetry.scrape_period(w.label),
        "sessions": gw.placement.load().get(w.url, 0),
        "requests_in_flight": gw.in_flight_by_worker[w.url],
        "gpu": _gpu(None if gpus is None else gpus.get(w.label)),
        "scheduler": _worker_sched(gw, w.label),
    }


def _worker_sched(gw: Gateway, label: str) -> WorkerSchedState:
    """Priority mode, dispatch gate and queue, KV ledger of one worker (ids without tenant)."""
    shell = gw.scheduler
    core, now = shell.core, shell.now()
    queue = core.queue(now, label)
    return {
        "mode": shell.mode(label), "mode_reason": shell.mode_reason[label],
        "in_flight": core.in_flight(label), "cap": core.cap(label),
        "running_blocks": core.running_blocks(label), "usable_blocks": core.usable_blocks(label),
        "dispatched_total": core.dispatched_total[label], "queue_length": len(queue),
        "queue": [
            {"session": unscoped_id(t.session), "level": t.level, "priority": t.priority,
             "waited_s": max(0.0, now - t.arrived), "blocks": t.blocks, "bypassed": t.bypassed}
            for t in queue[:50]
        ],
        "retained_blocks": core.retained_blocks(label),
        "reservations": [
            {"session": unscoped_id(r.session), "blocks": r.blocks, "level": r.level,
             "expires_in_s": max(0.0, r.expires_at - now)}
            for r in core.ledger.reservations(label)[:50]
        ],
    }


def _scheduler(gw: Gateway) -> SchedState:
    core, scfg = gw.scheduler.core, gw.cfg.scheduler
    r = core.resumes
    return {
        "priority_policy": scfg.priority_policy,
        "retention_policy": scfg.retention_policy,
        "hint_encoder": scfg.hint_encoder,
        "levels_total": {str(k): v for k, v in core.levels_total.items()},
        "backfilled_total": core.backfilled_total,
        "resumes": {
            "warm": sum(r.warm.values()), "cold": sum(r.cold.values()),
            "warm_retained": r.warm[True], "hit_rate": finite(r.hit_rate),
            "cached_tokens": r.cached_tokens, "context_tokens": r.context_tokens,
        },
    }


def _gpu(g: GpuPressure | None) -> GpuState:
    if g is None or not g.available:
        return {"available": False, "memory_used_frac": None, "utilization_pct": None}
    return {
        "available": True,
        "memory_used_frac": finite(g.memory_used_frac),
        "utilization_pct": finite(g.utilization_pct),
    }


def _cpu(gw: Gateway) -> CpuState:
    probe, c = gw.telemetry.cpu_probe, gw.telemetry.cpu.latest
    return {
        "source": c.source if c is not None else (probe.sources[0] if probe.sources else ""),
        "psi_some_avg10": None if c is None else finite(c.psi_some_avg10),
        "psi_some_avg60": None if c is None else finite(c.psi_some_avg60),
        "throttled_usec": None if c is None else c.throttled_usec,
        "cpu_percent": None if c is None else finite(c.cpu_percent),
        "tool_cpus": probe.tool_cpus,
    }


def _tools(gw: Gateway) -> ToolsState:
    t = gw.telemetry.tracker
    return {
        "in_flight": t.in_flight,
        "backlog_ratio": t.backlog_ratio(gw.telemetry.wall()),
        "queue_wait_ema_s": t.queue_wait_ema,
        "slowdown_ema": t.slowdown_ema,
    }


def _sessions(gw: Gateway, *, details: bool, limit: int, offset: int) -> SessionsState:
    tools = {s: (tool, start) for s, tool, start in gw.telemetry.tracker.sessions_in_tool_phase()}
    counts: dict[str, int] = dict.fromkeys(SESSION_STATES, 0)
    rows: list[SessionDetail] = []
    keys = gw.sessions.keys()
    mono, wall = gw.now(), time.time()
    sched, trees = gw.scheduler.core, gw.plane.trees
    for i, key in enumerate(keys):
        sess = gw.sessions.get(key)
        if sess is None:
            continue
        state: SessionState
        if sess.in_flight:
            state = "llm"
        elif key in tools:
            state = "tool"
        else:
            state = "idle"
        counts[state] += 1
        if details and offset <= i < offset + limit:
            url = gw.placement.worker_of(key)
            tool = tools.get(key)
            held = sched.ledger.reservation(key)
            rows.append(
                {
                    "id": unscoped_id(key),
                    "worker": "" if url is None else gw.workers[url].label,
                    "state": state,
                    "turns": sess.turns,
                    "tool": tool[0] if state == "tool" and tool else None,
                    "since_s": max(
                        0.0, wall - tool[1] if state == "tool" and tool else mono - sess.last_seen
                    ),
                    "age_s": max(0.0, mono - gw.sessions.born(key, mono)),
                    "level": sched.level_of(key),
                    "retained_blocks": 0 if held is None else held.blocks,
                    "parent": _unscoped(trees.parent_of(key)),
                }
            )
    # Bounded like the other id lists: the document is built at every poll and scrape.
    forest = {unscoped_id(p): [unscoped_id(c) for c in kids]
              for p, kids in trees.forest(SHOWN_IDS).items()}
    out: SessionsState = {"total": len(keys), "by_state": counts, "trees": forest,
                          "linked": len(trees)}
    if details:
        out["details"] = rows
    return out


def _unscoped(key: str | None) -> str | None:
    return None if key is None else unscoped_id(key)
