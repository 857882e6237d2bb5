"""The gateway's state: config, session table, placement, worker health, metrics, upstream,
and the information stream (bus, probes, tool tracker).

Built from config and passed around (no globals). The relay handlers call into it; the demo
and tests read ``stats()``; the admin API reads and ends sessions through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from marsproxy.aimd.admission import DecisionKind
from marsproxy.config import MarsConfig, WorkerConfig
from marsproxy.core.answers import ReplyKind
from marsproxy.core.canon import Reply
from marsproxy.core.events import SessionEnd
from marsproxy.core.session_record import EndReason as Ending
from marsproxy.core.sessions import Session, Turn
from marsproxy.gateway.http.health import HealthChecker, WorkerHealth
from marsproxy.gateway.http.sse import Usage
from marsproxy.gateway.http.upstream import Picker, Upstream
from marsproxy.gateway.shells.admission import AdmissionShell
from marsproxy.gateway.shells.admission_types import END_REASONS, Granted, Refused, Verdict
from marsproxy.gateway.shells.background import BackgroundCalls
from marsproxy.gateway.shells.kv_events import KVEventsShell
from marsproxy.gateway.shells.kv_use import KVUse
from marsproxy.gateway.shells.metrics import GatewayMetrics
from marsproxy.gateway.shells.observations import observations
from marsproxy.gateway.shells.replicas import ReplyLink
from marsproxy.gateway.shells.replies import Replies
from marsproxy.gateway.shells.scheduler import Prepared, SchedulerShell
from marsproxy.gateway.shells.sessions import EndReason, ObservedSessions
from marsproxy.gateway.shells.telemetry import Telemetry
from marsproxy.policy.log import DecisionLog
from marsproxy.policy.observe import WorkerObservation
from marsproxy.policy.plane import ControlPlane
from marsproxy.sched.placement import Placement

log = logging.getLogger("marsproxy.gateway.shells.service")


class Gateway:
    def __init__(self, cfg: MarsConfig, *, clock: Callable[[], float] = time.monotonic,
                 log: DecisionLog | None = None) -> None:
        """``clock``: the control clock fed to the plane; ``log``: record the plane's
        decisions (the parity test)."""
        self.cfg = cfg
        self.now = clock
        self.workers: dict[str, WorkerConfig] = {w.url: w for w in cfg.workers}
        self._urls = {w.label: w.url for w in cfg.workers}
        self.metrics = GatewayMetrics()
        self.telemetry = tel = Telemetry(cfg, self.metrics)
        # The one control plane: every decision about a session is its.
        self.plane = ControlPlane(cfg, [w.label for w in cfg.workers],
                                  tool_cpus=tel.cpu_probe.tool_cpus,
                                  tools=(tel.tracker, tel.tool_signal), log=log)
        tel.busy = self._busy
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
        self.observe: Callable[[], dict[str, WorkerObservation]] = self._probed
        """What the plane hears about the workers (the probes; a test may script it)."""
        # Admission control's I/O (held requests, the window store); None: admission is off,
        # every session is placed at once by the plane.
        self.admission = (
            AdmissionShell(cfg, self.plane, tel, self.health, self.metrics,
                           http=lambda: self.upstream.session, clock=clock)
            if cfg.admission.enabled
            else None
        )
        if self.admission is not None:
            self.admission.observe = lambda: self.observe()
            tel.scraped = self.admission.scraped
        # Stored Responses replies: the worker that made each (calls naming one go there).
        self.replies = Replies(cfg, self.workers, self.health, self.sessions, self.admission,
                               http=lambda: self.upstream.session, metrics=self.metrics,
                               clock=clock)
        # Background Responses: their calls stay open until the worker's response has ended.
        self.background = BackgroundCalls(
            lambda: self.upstream.session, interval_s=cfg.health.interval_s,
            request_timeout_s=cfg.health.timeout_s, limit_s=cfg.upstream.first_byte_timeout_s,
            unanswered=cfg.health.unhealthy_after, clock=clock)
        self.metrics.background_calls.set_function(lambda: len(self.background))
        # The agent-centric scheduler: levels, gated dispatch, retention.
        self.scheduler = SchedulerShell(cfg, self.plane, tel, self.metrics,
                                        observe=lambda: self.observe(), clock=clock)
        # The workers' KV indexes from their KV events; None: no worker publishes them.
        self.kv_events = (
            KVEventsShell(cfg, engine_blocks=lambda label: getattr(
                self.plane.observed.get(label), "total_blocks", None))
            if any(w.kv_events for w in cfg.workers) else None
        )
        self.kv_use = (None if self.kv_events is None else
                       KVUse(cfg, self.kv_events, self.metrics, lambda: self.upstream.session,
                             lambda label: self.plane.observed[label].block_size))
        self.requests_per_worker: Counter[str] = Counter()
        self.in_flight_by_worker: Counter[str] = Counter()  # by url
        self._expiry: asyncio.Task[None] | None = None
        self._plane_tick: asyncio.Task[None] | None = None
        for w in cfg.workers:
            self.metrics.worker_healthy.labels(w.label).set(1)

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
        if self.admission is None:  # else the admission shell's control loop ticks the plane
            self._plane_tick = asyncio.create_task(self._plane_loop(), name="marsproxy-plane")

    async def stop(self) -> None:
        await self.background.close()  # their calls end while the planes still run
        for task in (self._expiry, self._plane_tick):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.kv_events is not None:
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
            try:
                self.sessions.expire(self.now())
            except Exception:  # a failed pass must not stop the next
                log.exception("session expiry failed")

    def _probed(self) -> dict[str, WorkerObservation]:
        obs = observations(self.cfg.workers, self.telemetry, self.health)
        if self.kv_use is not None:  # each session's resident blocks, where an index is usable
            for label, o in obs.items():
                blocks = self.kv_use.session_blocks(label)
                if blocks is not None:
                    obs[label] = dataclasses.replace(o, session_blocks=blocks)
        return obs

    def _busy(self, worker: str) -> bool:
        """Calls in flight on ``worker``, or sessions waiting: for admission (any worker may
        take them) or in its dispatch gate."""
        plane = self.plane
        return (self.in_flight_by_worker[self._urls[worker]] > 0
                or len(plane.admission.queue) > 0 or plane.pending_count > 0
                or plane.scheduler.queue_length(worker) > 0)

    async def _plane_loop(self) -> None:
        # Admission off: the plane still ticks (KV holds and idle timeouts steer placement).
        while True:
            try:
                self.tick_plane()
            except Exception:  # a failed tick must not stop the next
                log.exception("control plane tick failed")
            await asyncio.sleep(self.cfg.admission.tuning.control_interval_s)

    def tick_plane(self) -> None:
        """The plane's control tick with admission off (its window decides nothing then)."""
        tel = self.telemetry
        self.plane.tick(self.now(), self.observe(), at=tel.wall(), cpu=tel.cpu.latest)

    # -- the request's decisions ---------------------------------------------------------------
    async def admit(self, key: str, tenant: str, chars: int, final: bool,
                    body: bytes | None = None, tokens: int | None = None,
                    cls: str | None = None, prefix: dict[str, int] | None = None,
                    parent: str | None = None, reply: ReplyLink | None = None) -> Verdict:
        """The worker for a request of ``key`` (held until admitted), or its refusal;
        ``prefix``: its prompt's resident prefix per indexed worker (prefix placement);
        ``parent``: the session a new one names as its parent (agent trees); ``reply``: the
        reply it continues (:meth:`Replies.link`)."""
        if self.admission is not None:
            return await self.admission.admit(key, tenant, chars, final, body, tokens, cls,
                                              prefix, parent, reply)
        ans = self.plane.request(self.now(), key, tenant, chars=chars, tokens=tokens,
                                 final=final, cls=cls, prefix=prefix, parent=parent,
                                 bound=None if reply is None else reply.worker)
        if ans.kind is DecisionKind.ADMITTED and ans.worker is not None:
            return Granted(ans.worker, 0.0, ans.incarnation)
        return Refused(503, "no_healthy_worker", 1, "no worker to place the session on")

    def call_ended(self, key: str, prepared: Prepared | None, *, ok: bool,
                   usage: Usage | None, engine_s: float, continues: bool, admitted: bool,
                   chars: int, incarnation: int | None, reply: ReplyKind | None = None) -> bool:
        """A call is over (well or not): the plane decides retention, then (for an admitted
        request) what its end means for admission; the shells carry it out. True: its reply
        answered and ended the session (``core/answers.py``). ``incarnation``: the session its
        request was admitted into (``Granted.incarnation``; ``None``: not admitted)."""
        u = usage or Usage()
        ticket = None if prepared is None else prepared.ticket
        # The plane asks the tracker first; an adopted session's carried estimate is the fallback.
        usual = None if self.admission is None else self.admission.replicas.carried_tool_s(key)
        end = self.plane.call_end(
            self.now(), key, ticket, incarnation=incarnation, ok=ok and usage is not None,
            admitted=admitted, prompt_tokens=None if usage is None else u.prompt_tokens,
            completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens, chars=chars,
            engine_s=engine_s, continues=continues, usual_tool_s=usual, reply=reply)
        self.scheduler.finished(prepared, end, usage)
        if admitted and self.admission is not None:
            self.admission.call_ended(key, end.outcome, u.prompt_tokens + u.completion_tokens)
        return end.answered

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

    def turn_finished(self, turn: Turn, *, ok: bool, reply: Reply | None,
                      response_id: str | None) -> None:
        """The session table learns how ``turn`` ended; a Responses reply id it may be
        continued from is remembered with the worker that made it (:class:`Replies`)."""
        if ok and response_id:  # before finish may forget the session
            url = self.placement.worker_of(turn.session)
            if url is not None:
                self.reply_made(turn, response_id, url)
        self.sessions.finish(turn, ok=ok, reply=reply, now=self.now(), response_id=response_id)

    def reply_made(self, turn: Turn, response_id: str, url: str) -> None:
        """``turn``'s reply ``response_id`` came from the worker at ``url``: calls naming it go
        there (also a background reply's, before its call ends: the client's polls)."""
        sess = self.sessions.of(turn)
        if sess is not None:
            self.replies.made(sess.tenant, response_id, turn.session, url)

    def response_ended(self, turn: Turn) -> None:
        """A response ended well and the session goes on: its tool phase begins (inferred)."""
        sess = self.sessions.of(turn)
        if sess is None or sess.ephemeral or sess.in_flight:
            return  # ended (final turn, or a new one of its id), one-shot, or another runs
        tel = self.telemetry
        tel.publish_tools(tel.tracker.response_ended(turn.session, tel.wall()))

    def session_over(self, key: str, end: Ending) -> None:
        """The plane hears that ``key`` is over for its client; the shells carry it out."""
        if self.admission is not None:
            out = self.admission.session_forgotten(key, end)
        else:
            out = self.plane.session_end(self.now(), key, end)
        self.scheduler.count_returned(out.returned)

    def _session_ended(
        self, sess: Session, reason: EndReason, duration_s: float, served_s: float | None
    ) -> None:
        # The one place every session of this replica ends (the table's forget): its latency
        # is observed here, once per session, never per request.
        if served_s is not None:
            self.metrics.session_duration.labels(reason).observe(served_s)
        self.session_over(sess.key, END_REASONS.get(reason, Ending.EVICTED))
        bus = self.telemetry.bus
        if not bus.subscribers:
            bus.skip()  # nobody to read it: not built
            return
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

    async def passthrough_picker(self, path: str, headers: Mapping[str, str]) -> Picker:
        """Where a pass-through request goes (a stored response's routes: its worker)."""
        return await self.replies.picker(path, headers, self.pick_any, self._sent)

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
        if not healthy:  # what waits in its dispatch gate goes elsewhere (relay.py)
            self.scheduler.ejected(url)

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
