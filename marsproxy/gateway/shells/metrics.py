"""Prometheus metrics of one gateway (its own registry: no process globals).

Labels are bounded: route (the four scheduled routes, ``passthrough`` or ``admin``), status
code, error kind, worker label. Never a session id.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    ProcessCollector,
    generate_latest,
)

from marsproxy.gateway.shells.sessions import END_REASONS
from marsproxy.telemetry.tallies import Distribution, Level, Tally, TallyCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOOL_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Agent sessions run from a one-shot request (seconds) to hours of tool-heavy turns.
_SESSION_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class _Unlabelled(Distribution):
    """A histogram without labels, observed directly (as ``prometheus_client``'s)."""

    def __init__(self, name: str, documentation: str, buckets: Iterable[float]) -> None:
        super().__init__(name, documentation, (), buckets)
        self.observe = self.labels().observe


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Leak checks (fault tests, soak, operators): tasks of the event loop, and the standard
        # process_* metrics (open fds, resident memory, CPU) of this process.
        Gauge(
            "marsproxy_event_loop_tasks", "asyncio tasks alive in the gateway's event loop.",
            registry=r,
        ).set_function(_loop_tasks)
        ProcessCollector(registry=r)
        # The request path's metrics: lock-free tallies (telemetry.tallies), exposed by one
        # collector in the same format as prometheus_client's Counter and Histogram.
        self.requests = Tally(
            "marsproxy_requests", "Requests answered, by route and status code.",
            ["route", "code"],
        )
        self.latency = Distribution(
            "marsproxy_request_duration_seconds", "Request time in the proxy, end to end.",
            ["route"], _LATENCY_BUCKETS,
        )
        self.overhead = Distribution(
            "marsproxy_proxy_overhead_seconds",
            "Time spent in the proxy, excluding the upstream (streams: up to the headers).",
            ["route"], _OVERHEAD_BUCKETS,
        )
        self.worker_requests = Tally(
            "marsproxy_worker_requests", "Requests sent to each worker.", ["worker"]
        )
        self.tokens = Tally("marsproxy_tokens", "Tokens reported in upstream usage.", ["kind"])
        self.ttft = Distribution(
            "marsproxy_ttft_seconds",
            "Time from a request's arrival to its first response bytes (streams: first event).",
            ["route"], _LATENCY_BUCKETS,
        )
        self.tool_duration = Distribution(
            "marsproxy_tool_duration_seconds",
            "Tool phases of sessions, inferred (gap between turns) or reported explicitly.",
            ["inferred"], _TOOL_BUCKETS,
        )
        TallyCollector(
            [self.requests, self.latency, self.overhead, self.worker_requests, self.tokens,
             self.ttft, self.tool_duration]
        ).register(r)
        self.in_flight = Level()
        Gauge(
            "marsproxy_requests_in_flight", "Requests being handled now.", registry=r
        ).set_function(lambda: self.in_flight.value)
        # Set by the gateway to its BackgroundCalls' count (shells/background.py).
        self.background_calls = Gauge(
            "marsproxy_background_calls", "Calls of background Responses still generating on"
            " a worker after their reply (queued) or their client left.", registry=r)
        self.upstream_errors = Tally(
            "marsproxy_upstream_errors",
            "Failures talking to workers, by kind.",
            ["worker", "kind"],
        )
        self.worker_healthy = Gauge(
            "marsproxy_worker_healthy",
            "1 when the worker takes new sessions.",
            ["worker"],
            registry=r,
        )
        # Observed once per session and per held request, on the request path: tallies too.
        self.session_duration = Distribution(
            "marsproxy_session_duration_seconds",
            "Sessions from their first request to the end of their last good response, observed"
            " once as each ends, by end reason (final, idle, evicted, deleted); sessions that"
            " never got a response are not observed.",
            ["reason"], _SESSION_BUCKETS,
        )
        for reason in END_REASONS:  # every reason's series exists from the start, at zero
            self.session_duration.labels(reason)
        self.admission_wait = _Unlabelled(
            "marsproxy_admission_wait_seconds",
            "Time a new session waited in the admission queue before a slot was confirmed.",
            _WAIT_BUCKETS,
        )
        self.rejections = Tally(
            "marsproxy_rejections",
            "Requests refused by admission, by reason (queue_full: 429; queue_deadline,"
            " no_healthy_worker, store_unavailable, session_ended, shutting_down: 503).",
            ["reason"],
        )
        self.refused = Tally(
            "marsproxy_refused",
            "Requests and connections refused before relaying or admission, by status (400"
            " malformed head or path, 401 admin token, 403 operator route of the workers, 404/405"
            " unknown route or method, 408"
            " slow body, 413 body too large, 429 connection cap, 431 head too large).",
            ["status"],
        )
        # -- scheduler ------------------------------------------------
        self.continuations = Tally(
            "marsproxy_continuations",
            "Scheduled continuations by level at arrival (las; none: the policy has no levels).",
            ["level"],
        )
        self.dispatch_wait = _Unlabelled(
            "marsproxy_dispatch_wait_seconds",
            "Time continuations waited in a gated worker's dispatch queue.",
            _WAIT_BUCKETS,
        )
        self.resumes = Tally(
            "marsproxy_resumes",
            "Continuations back from a tool phase, by outcome (warm: cached prompt tokens cover"
            " scheduler.tuning.warm_resume_min_frac of the context it left with) and whether its"
            " prefix was retained.",
            ["outcome", "retained"],
        )
        self.resume_tokens = Tally(
            "marsproxy_resume_tokens",
            "Prompt tokens of resumed continuations (prompt) and of those the worker found in its"
            " prefix cache (cached, from usage.prompt_tokens_details.cached_tokens).",
            ["kind"],
        )
        self.retention_decisions = Tally(
            "marsproxy_retention_decisions",
            "KV retention decisions at the end of continuations, by outcome.",
            ["retain"],
        )
        self.ledger_released = Tally(
            "marsproxy_kv_ledger_released",
            "Reservations that left the KV ledger other than by their session's return, by"
            " reason (expired, pressure, session_end).",
            ["worker", "reason"],
        )
        # The workers' KV indexes in use (docs/kv-events.md).
        self.kv_predictions = Tally(
            "marsproxy_kv_predictions",
            "Predictions of a call's cached_tokens from its worker's KV index, against the"
            " usage it reported: exact, within_block (off by at most one block) or off.",
            ["worker", "outcome"],
        )
        self.kv_tokenize = Tally(
            "marsproxy_kv_tokenize", "Prompts tokenized for the KV index (ok, failed).",
            ["result"])
        self.kv_tokenize_seconds = Tally(
            "marsproxy_kv_tokenize_seconds", "Time spent waiting for /tokenize.", [])
        self.retention_verified = Tally(
            "marsproxy_retention_verified",
            "Retained prefixes at their session's resume, by what the worker's KV index found:"
            " kept, partly_kept, lost.",
            ["worker", "outcome"],
        )
        self.retention_corrected = Tally(
            "marsproxy_retention_corrected",
            "Retention reservations shrunk because the engine evicted part of the prefix.",
            ["worker"],
        )
        self.reply_lookups = Tally(
            "marsproxy_reply_lookups",
            "Calls naming a stored Responses reply this replica's session table does not hold,"
            " by where its worker was found: here (recent replies), store (another replica),"
            " workers (asked) or none.",
            ["source"],
        )
        # Counters the scheduler and admission update per request: tallies too.
        TallyCollector(
            [self.session_duration, self.admission_wait, self.dispatch_wait,
             self.upstream_errors, self.rejections, self.refused, self.continuations,
             self.resumes,
             self.resume_tokens, self.retention_decisions, self.ledger_released,
             self.kv_predictions, self.kv_tokenize, self.kv_tokenize_seconds,
             self.retention_verified, self.retention_corrected, self.reply_lookups]
        ).register(r)
        # The bounded label sets of the scheduler's counters exist from the start, at zero,
        # so a dashboard's ratios of them have data before the first warm resume.
        for outcome in ("warm", "cold"):
            for retained in ("true", "false"):
                self.resumes.labels(outcome, retained)
        for kind in ("cached", "prompt"):
            self.resume_tokens.labels(kind)
        for retain in ("true", "false"):
            self.retention_decisions.labels(retain)
        for source in ("here", "store", "workers", "none"):
            self.reply_lookups.labels(source)
        # Gauges read at scrape time (worker pressure, CPU, tools, sessions by state, event
        # counts) come from a collector over the state document: see telemetry.prometheus.

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _loop_tasks() -> float:
    try:
        return float(len(asyncio.all_tasks()))
    except RuntimeError:  # rendered outside the event loop: nothing to count
        return 0.0
