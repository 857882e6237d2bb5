"""The gateway's state: config, session table, placement, worker health, metrics, upstream,
and the information stream (bus, probes, tool tracker).

Built from config and passed around (no globals). The relay handlers call into it; the demo
and tests read ``stats()``; the admin API reads and ends sessions through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from marsproxy.config import MarsConfig, WorkerConfig
from marsproxy.core.events import SessionEnd
from marsproxy.core.sessions import Session, Turn
from marsproxy.gateway.http.health import HealthChecker, WorkerHealth
from marsproxy.gateway.http.upstream import Upstream
from marsproxy.gateway.shells.admission import AdmissionShell
from marsproxy.gateway.shells.kv_events import KVEventsShell
from marsproxy.gateway.shells.metrics import GatewayMetrics
from marsproxy.gateway.shells.scheduler import SchedulerShell
from marsproxy.gateway.shells.sessions import EndReason, ObservedSessions
from marsproxy.gateway.shells.telemetry import Telemetry
from marsproxy.sched.placement import Placement

log = logging.getLogger("marsproxy.gateway.shells.service")


class Gateway:
    def __init__(self, cfg: MarsConfig) -> None:
        self.cfg = cfg
        self.workers: dict[str, WorkerConfig] = {w.url: w for w in cfg.workers}
        self.metrics = GatewayMetrics()
        self.telemetry = Telemetry(cfg, self.metrics)
        self.placement = Placement([w.url for w in cfg.workers])
        self.sessions = ObservedSessions(
            idle_ttl_s=cfg.sessions.idle_ttl_s,
            max_sessions=cfg.sessions.max_sessions,
            chain_matching=cfg.sessions.chain_matching,
            max_per_tenant=cfg.limits.max_sessions_per_tenant,
            max_id_chars=cfg.limits.max_session_id_chars,
            on_forget=self.placement.release,
            on_end=self._session_ended,
        )
        self.health = WorkerHealth(
            list(self.workers),
            unhealthy_after=cfg.health.unhealthy_after,
            healthy_after=cfg.health.healthy_after,
        )
        self.checker = HealthChecker(cfg.workers, self.health, cfg.health, self._health_changed)
        self.upstream = Upstream(cfg.upstream, on_error=self._upstream_error)
        # Admission control; None: every session is served at once, as before.
        self.admission = (
            AdmissionShell(cfg, self.telemetry, self.health, self.metrics,
                           http=lambda: self.upstream.session)
            if cfg.admission.enabled
            else None
        )
        # The agent-centric scheduler: levels, gated dispatch, retention.
        self.scheduler = SchedulerShell(cfg, self.telemetry, self.metrics)
        if self.admission is not None:
            # The KV ledger's reservations come off the admission budget (retention is real).
            self.admission.retained_blocks = self.scheduler.retained_blocks
        # -- KV events (issue 24): the workers' KV indexes; None: no worker has kv_events --
        self.kv_events = (
            KVEventsShell(cfg) if any(w.kv_events for w in cfg.workers) else None
        )
        # -- end KV events --
        self.requests_per_worker: Counter[str] = Counter()
        self.in_flight_by_worker: Counter[str] = Counter()  # by url
        self._expiry: asyncio.Task[None] | None = None
        for w in cfg.workers:
            self.metrics.worker_healthy.labels(w.label).set(1)

    @staticmethod
    def now() -> float:
        """The clock fed to the sans-IO core."""
        return time.monotonic()

    async def start(self) -> None:
        try:
            await self.upstream.start()
            assert self.upstream.session is not None
            self.checker.start(self.upstream.session)
            await self.telemetry.start()
            if self.admission is not None:
                await self.admission.start()
            await self.scheduler.start()
            if self.kv_events is not None:  # KV events (issue 24)
                await self.kv_events.start()
        except BaseException:
            # Refused at start (a store that rejects our credentials): close what did start, so
            # the refusal is the last word and no client session is left open behind it.
            try:
                await self.stop()
            except Exception:  # the refusal is what the caller reports; this is a footnote
                log.warning("closing what had started after a failed start failed", exc_info=True)
            raise
        self._expiry = asyncio.create_task(self._expire_loop(), name="marsproxy-session-expiry")

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        if self.kv_events is not None:  # KV events (issue 24)
            await self.kv_events.stop()
        await self.scheduler.stop()
        if self.admission is not None:
            await self.admission.stop()
        await self.checker.stop()
        await self.upstream.close()
        await self.telemetry.stop()

    async def _expire_loop(self) -> None:
        # The table only expires lazily (on the next request); this makes idle session_end
        # events and the state's session counts timely when traffic stops.
        period = min(1.0, self.cfg.sessions.idle_ttl_s / 4)
        while True:
            await asyncio.sleep(period)
            self.sessions.expire(self.now())

    # -- session lifecycle (feeds the tool tracker and the event stream) -------------------

    def request_arrived(self, turn: Turn) -> int:
        """A scheduled request joined ``turn.session``: end its tool phase; its turn number."""
        sess = self.sessions.get(turn.session)
        if sess is None:
            return 0
        if not sess.ephemeral:
            tel = self.telemetry
            tel.publish_tools(tel.tracker.request_started(turn.session, tel.wall()))
        return sess.turns

    def response_ended(self, turn: Turn) -> None:
        """A response ended well and the session goes on: its tool phase begins (inferred)."""
        sess = self.sessions.get(turn.session)
        if sess is None or sess.ephemeral or sess.in_flight:
            return  # ended (final turn), one-shot, or another request of it still runs
        tel = self.telemetry
        tel.publish_tools(tel.tracker.response_ended(turn.session, tel.wall()))

    def _session_ended(
        self, sess: Session, reason: EndReason, duration_s: float, served_s: float | None
    ) -> None:
        # The one place every session of this replica ends (the table's forget): its latency
        # is observed here, once per session, never per request.
        if served_s is not None:
            self.metrics.session_duration.labels(reason).observe(served_s)
        self.telemetry.tracker.session_ended(sess.key)
        self.scheduler.session_ended(sess.key)
        if self.admission is not None:
            self.admission.session_forgotten(sess.key, reason)
        worker = self.placement.worker_of(sess.key)
        self.telemetry.publish(
            SessionEnd(
                ts=self.telemetry.wall(),
                session=sess.key,
                worker=None if worker is None else self.workers[worker].label,
                reason=reason,
                turns=sess.turns,
                duration_s=duration_s,
            )
        )

    # -- decisions ------------------------------------------------------------------------------

    def healthy(self) -> list[str]:
        return self.health.healthy()

    def pick_for_session(self, session: str, tried: Iterable[WorkerConfig]) -> WorkerConfig | None:
        url = self.placement.assign(session, self.healthy(), exclude={w.url for w in tried})
        return None if url is None else self._sent(url)

    def admitted_to(self, session: str, label: str) -> None:
        """Admission put ``session`` on the worker labelled ``label``: placement follows."""
        url = next(u for u, w in self.workers.items() if w.label == label)
        if self.health.is_healthy(url):  # else placement's failover decides, as without admission
            self.placement.pin(session, url)

    def pick_any(self, tried: Iterable[WorkerConfig]) -> WorkerConfig | None:
        url = self.placement.least_loaded(self.healthy(), exclude={w.url for w in tried})
        return None if url is None else self._sent(url)

    def _sent(self, url: str) -> WorkerConfig:
        worker = self.workers[url]
        self.requests_per_worker[worker.label] += 1
        self.metrics.worker_requests.labels(worker.label).inc()
        return worker

    def _upstream_error(self, worker: WorkerConfig, kind: str) -> None:
        self.metrics.upstream_errors.labels(worker.label, kind).inc()
        if kind == "connect":
            # A refused connect is as good a sign as a failed health check.
            self.checker.record(worker, False)

    def _health_changed(self, url: str, healthy: bool) -> None:
        self.metrics.worker_healthy.labels(self.workers[url].label).set(1 if healthy else 0)

    # -- reading --------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """A summary for the demo and for tests: requests and sessions per worker."""
        labels = {url: w.label for url, w in self.workers.items()}
        return {
            "requests_per_worker": {
                w.label: self.requests_per_worker[w.label] for w in self.cfg.workers
            },
            "sessions_per_worker": {labels[u]: n for u, n in self.placement.load().items()},
            "session_workers": {s: labels[u] for s, u in self.placement.assignments().items()},
            "healthy": {labels[u]: ok for u, ok in self.health.snapshot().items()},
            "sessions": len(self.sessions),
        }
