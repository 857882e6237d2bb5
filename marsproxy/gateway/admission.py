"""The admission shell: feeds the pure ``AdmissionCore`` and carries out what it decides.

The core decides (window, queue order, KV fit, idle timeouts, deadlines); this shell only
feeds it events (requests, response ends, session ends, control ticks with the latest
signals) and carries out its actions: wake held requests, answer expired ones, publish events,
release leases.

Core ↔ store. The local core proposes every admission; the ``WindowStore`` confirms it, so the
store is the arbiter of the global count when several replicas share one Redis. A proposed
session is *pending*: the core already counts it on its worker (so this replica proposes no
more than its limit there), its request stays held, and it sits in the store's global queue
scored by its arrival time. It is confirmed with ``admit_if_ranked`` (rank below the free slots
of all workers, and room on its worker under the published limit), retried on every control
tick and every store wake-up, and answered 503 when its queue deadline passes first. Sessions
the core itself holds back (WAIT) stay out of the global queue: they wait for local reasons,
and counting them there would block the pending ones behind them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from marsproxy.aimd.admission import Actions, AdmissionCore, DecisionKind
from marsproxy.aimd.stores import WindowRecord, WindowStore, make_store, wall_clock_ms
from marsproxy.config import MarsConfig
from marsproxy.core.events import Event, Rejected, SessionAdmitted, SessionEnd
from marsproxy.core.lifecycle import EndReason, SessionState
from marsproxy.gateway.admission_signals import all_signals
from marsproxy.gateway.admission_types import END_REASONS, Granted, Pending, Refused, Verdict
from marsproxy.gateway.health import WorkerHealth
from marsproxy.gateway.metrics import GatewayMetrics
from marsproxy.gateway.telemetry import Telemetry

log = logging.getLogger("marsproxy.gateway.admission")

class AdmissionShell:
    def __init__(
        self,
        cfg: MarsConfig,
        telemetry: Telemetry,
        health: WorkerHealth,
        metrics: GatewayMetrics,
        store: WindowStore | None = None,
    ) -> None:
        self.cfg = cfg
        self.acfg = cfg.admission
        self.telemetry, self.health, self.metrics = telemetry, health, metrics
        self.urls = {w.label: w.url for w in cfg.workers}
        self.core = AdmissionCore(cfg.admission, list(self.urls))
        self.store: WindowStore = store if store is not None else make_store(cfg.store)
        self._waiters: dict[str, list[asyncio.Future[Verdict]]] = {}
        self._arrival: dict[str, tuple[float, int]] = {}  # waiting in the core: (mono, ms)
        self._pending: dict[str, Pending] = {}
        self._held: dict[str, str] = {}  # confirmed session → worker label
        self._unclaimed: dict[str, Refused] = {}  # refusals that found no waiter yet
        self._arriving: dict[str, int] = {}  # requests between on_request and waiting
        self._closing = False
        self._stopping = False
        self._windows: dict[str, WindowRecord] = {}  # as published by the leader
        self._store_admitted: dict[str, int] = dict.fromkeys(self.urls, 0)
        self._confirm_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []

    @staticmethod
    def now() -> float:
        """The clock fed to the core (the gateway's: monotonic seconds)."""
        return time.monotonic()

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        await self.store.start()
        self._loops = [
            asyncio.create_task(self._control_loop(), name="marsproxy-admission-tick"),
            asyncio.create_task(self._wakeup_loop(), name="marsproxy-admission-wakeups"),
        ]

    def shutting_down(self) -> None:
        """Graceful stop begins: held requests get 503 now instead of holding up the drain."""
        self._closing = True
        for key in list(self._waiters):
            self._refuse(key, Refused(503, "shutting_down", 1, "the proxy is shutting down"))

    async def stop(self) -> None:
        self._stopping = True
        tasks = [*self._loops, *self._tasks]
        for t in tasks:
            t.cancel()
        if tasks:
            # Bounded: a cancel that a store call swallowed (e.g. turned into a timeout) must
            # not hang the shutdown; the loops also stop on the flag at their next turn.
            await asyncio.wait(tasks, timeout=2.0)
        self._loops, self._tasks = [], set()
        # A clean stop hands its slots back at once; a crash leaves them to the lease TTL.
        try:
            async with asyncio.timeout(2.0):
                for key, worker in list(self._held.items()):
                    await self.store.release(worker, key)
        except Exception as exc:  # the leases then expire within one TTL, as after a crash
            log.warning("admission: releasing held slots at shutdown failed: %r", exc)
        await self.store.close()

    async def _control_loop(self) -> None:
        while not self._stopping:
            try:
                await self.tick()
            except Exception:  # a failed tick must not stop admission for good
                log.exception("admission tick failed")
            await asyncio.sleep(self.acfg.control_interval_s)

    async def _wakeup_loop(self) -> None:
        # A lease released anywhere (this replica or another) may let a pending session in.
        async for _ in self.store.wakeups():
            if self._stopping:
                return
            try:
                await self._confirm_pending()
            except Exception:
                log.exception("admission re-check after a wake-up failed")

    # -- the control tick -----------------------------------------------------------------
    def _signals_now(self) -> Actions:
        tel = self.telemetry
        pressures = {w: tel.worker_pressure(w) for w in self.urls}
        healthy = {w: self.health.is_healthy(u) for w, u in self.urls.items()}
        signals = all_signals(
            pressures, healthy, tel.tracker, tel.cpu.latest, tel.cpu_probe.tool_cpus
        )
        return self.core.tick(self.now(), signals)

    async def tick(self) -> None:
        """One control step: core tick, pending deadlines, windows, then carry out."""
        actions = self._signals_now()
        self._expire_pending(actions)
        store, now_ms = self.store, wall_clock_ms()
        if await store.try_lead(now_ms):
            records = {
                w: WindowRecord(c.effective_limit, c.window, now_ms)
                for w, c in self.core.controllers.items()
            }
            await store.publish_windows(records)
        self._windows = await store.read_windows()
        for w in self.urls:
            self._store_admitted[w] = await store.admitted(w)
        await self._carry(actions)

    def limit(self, worker: str) -> int:
        """The limit the store enforces on ``worker``: the leader's if published, else ours."""
        rec = self._windows.get(worker)
        return rec.limit if rec is not None else self.core.controllers[worker].effective_limit

    def _expire_pending(self, actions: Actions) -> None:
        # The core's deadline covers its own queue; pending sessions are this shell's to expire.
        now = self.now()
        for key, p in list(self._pending.items()):
            if now - p.since >= self.acfg.queue_deadline_s:
                retry = self.core.queue.retry_after(now)
                self._refuse(key, Refused(503, "queue_deadline", retry,
                                          "no admission slot within the queue deadline"))
                self._drop_pending(key)
                more = self.core.on_session_end(now, key, EndReason.QUEUE_DEADLINE)
                actions.admitted += more.admitted
                actions.ended += more.ended
                actions.events += more.events

    # -- the request path -----------------------------------------------------------------
    async def admit(self, key: str, tenant: str, chars: int, final: bool) -> Verdict:
        """Admit a request of session ``key`` now, hold it until admitted, or refuse it."""
        core = self.core
        if key not in self._held and all(v.stale for v in core.views()):
            # Probably the first requests after start: use the first scrape at once.
            await self._carry(self._signals_now())
        now = self.now()
        est = core.estimator.estimate(key, chars)
        decision = core.on_request(now, key, tenant, est, final=final)
        if decision.kind is DecisionKind.REJECT:
            await self._carry(decision.actions)
            return self._rejected(decision.reason, decision.retry_after_s)
        if decision.kind is DecisionKind.WAIT:
            self._arrival.setdefault(key, (now, wall_clock_ms()))
        elif decision.reason != "continuation" and decision.worker is not None:
            self._arrival.setdefault(key, (now, wall_clock_ms()))
            self._propose(key, decision.worker)
        self._arriving[key] = self._arriving.get(key, 0) + 1
        try:
            await self._carry(decision.actions)
        except asyncio.CancelledError:
            self._abandon(key, None)  # the client left before its request could wait
            raise
        finally:
            self._arriving[key] -= 1
            if not self._arriving[key]:
                del self._arriving[key]
        early = self._unclaimed.pop(key, None)
        if key in self._held:  # confirmed, now or long ago (it may have waited a pass above)
            return Granted(self._held[key], 0.0)
        if early is None and core.sessions.get(key) is None:
            # Ended while this request was on its way (another request took the refusal).
            early = Refused(503, "session_ended", 1, "the session ended before it was admitted")
        if early is not None:
            self.metrics.rejections.labels(early.code).inc()
            return early
        return await self._hold(key)

    async def _hold(self, key: str) -> Verdict:
        if self._closing:
            return Refused(503, "shutting_down", 1, "the proxy is shutting down")
        fut: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            self._abandon(key, fut)
            raise

    def _abandon(self, key: str, fut: asyncio.Future[Verdict] | None) -> None:
        """A held client went away; the session ends if nobody else waits for it."""
        if fut is not None and fut.done() and not fut.cancelled() and isinstance(
            fut.result(), Granted
        ):
            # Admitted just before the client left: the request counts as served.
            self.response_ended(key, 0, None)
            return
        left = [f for f in self._waiters.get(key, []) if f is not fut and not f.done()]
        if left:
            self._waiters[key] = left
            return
        self._waiters.pop(key, None)
        rec = self.core.sessions.get(key)
        if rec is None:
            return
        if rec.state is SessionState.ADMITTED and key not in self._pending:
            if fut is None:  # it was counted in flight and will not be served: uncount it
                self.response_ended(key, 0, None)
            return
        self._drop_pending(key)
        self._arrival.pop(key, None)
        actions = self.core.on_session_end(self.now(), key, EndReason.ABANDONED)
        self._spawn(self._carry(actions))

    def response_ended(self, key: str, chars: int, prompt_tokens: int | None) -> None:
        """A request that was admitted finished (well or not): its usage corrects estimates."""
        usual = self.telemetry.tracker.predicted_duration(key)
        actions = self.core.on_response_end(
            self.now(), key, prompt_chars=chars, prompt_tokens=prompt_tokens or None,
            usual_tool_s=usual,
        )
        if actions.ended or actions.admitted or actions.events:
            self._spawn(self._carry(actions))

    def session_forgotten(self, key: str, reason: str) -> None:
        """The gateway's session table let ``key`` go (final, idle, evicted, deleted)."""
        end = END_REASONS.get(reason, EndReason.DELETED)
        actions = self.core.on_session_end(self.now(), key, end)
        # The table publishes its own session_end for this one.
        actions.events = [e for e in actions.events if e.session != key]
        if actions.ended or actions.admitted:
            self._spawn(self._carry(actions))

    # -- carrying out ---------------------------------------------------------------------
    async def _carry(self, actions: Actions) -> None:
        for a in actions.admitted:
            self._propose(a.entry.session, a.worker)
        for e in actions.expired:
            self._arrival.pop(e.session, None)
            self._refuse(e.session, Refused(
                e.status, e.reason, e.retry_after_s,
                "no admission slot within the queue deadline" if e.reason == "queue_deadline"
                else "no healthy worker to admit the session"))
        for key, reason in actions.ended:
            await self._ended(key, reason)
        self._publish(actions.events)  # before the confirmations: session_queued comes first
        if self._pending:
            await self._confirm_pending()

    def _propose(self, key: str, worker: str) -> None:
        arrived = self._arrival.pop(key, None)
        since, ms = arrived if arrived is not None else (self.now(), wall_clock_ms())
        self._pending[key] = Pending(worker, since, ms)

    async def _ended(self, key: str, reason: EndReason) -> None:
        self._arrival.pop(key, None)
        self._refuse(key, Refused(503, "session_ended", 1, f"the session ended ({reason})"))
        if self._drop_pending(key):
            return
        worker = self._held.pop(key, None)
        if worker is not None:
            await self.store.release(worker, key)

    def _drop_pending(self, key: str) -> bool:
        p = self._pending.pop(key, None)
        if p is None:
            return False
        self._spawn(self.store.dequeue(key))
        # The store may have granted it while the answer was lost (a confirmation pass
        # cancelled with its client's request): hand the slot back now, not a TTL later.
        self._spawn(self.store.release(p.worker, key))
        return True

    async def _confirm_pending(self) -> None:
        """Ask the store to confirm pending sessions, oldest first."""
        async with self._confirm_lock:
            if not self._pending:
                return
            store, now_ms = self.store, wall_clock_ms()
            free = 0
            for w in self.urls:
                self._store_admitted[w] = n = await store.admitted(w)
                free += max(0, self.limit(w) - n)
            for key, p in sorted(self._pending.items(), key=lambda kv: kv[1].arrival_ms):
                if not p.queued:
                    p.queued = True
                    await store.enqueue(key, float(p.arrival_ms))
                ok = await store.admit_if_ranked(key, free, p.worker, self.limit(p.worker),
                                                 now_ms)
                if self._pending.get(key) is not p:  # ended while we asked: undo
                    if ok:
                        await store.release(p.worker, key)
                    await store.dequeue(key)
                    continue
                if ok:
                    free -= 1
                    self._confirmed(key, p)
                elif store.mode == "closed":
                    self._store_closed(key)

    def _confirmed(self, key: str, p: Pending) -> None:
        del self._pending[key]
        self._held[key] = p.worker
        waited = max(0.0, self.now() - p.since)
        self.metrics.admission_wait.observe(waited)
        self.telemetry.publish(SessionAdmitted(ts=self.telemetry.wall(), session=key,
                                               worker=p.worker, wait_s=waited))
        for fut in self._waiters.pop(key, []):
            if not fut.done():
                fut.set_result(Granted(p.worker, waited))

    def _store_closed(self, key: str) -> None:
        # on_store_failure: closed — the shared state is unreachable, admit nothing new.
        self._refuse(key, Refused(503, "store_unavailable", 1,
                                  "admission state store unreachable (on_store_failure: closed)"))
        self._drop_pending(key)
        self._spawn(self._carry(self.core.on_session_end(self.now(), key, EndReason.ABANDONED)))

    def _refuse(self, key: str, verdict: Refused) -> None:
        futs = [f for f in self._waiters.pop(key, []) if not f.done()]
        if not futs and key in self._arriving:
            # Refused while its own request was still on the way to waiting: it takes this.
            self._unclaimed.setdefault(key, verdict)
            return
        if futs:
            self.metrics.rejections.labels(verdict.code).inc()
        for fut in futs:
            fut.set_result(verdict)

    def _rejected(self, reason: str, retry: int | None) -> Refused:
        self.metrics.rejections.labels(reason).inc()
        return Refused(429, reason, retry or 1, "admission queue full; retry later")

    def _publish(self, events: list[Event]) -> None:
        # Rejections are published by the relay when it answers; admissions once confirmed.
        for ev in events:
            if isinstance(ev, Rejected | SessionAdmitted):
                continue
            if isinstance(ev, SessionEnd) and ev.reason == EndReason.FINAL:
                continue  # the session table forgets it next and publishes that end
            self.telemetry.publish(ev)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- reading (for the state document) -------------------------------------------------
    def store_admitted(self, worker: str) -> int:
        """Live leases on ``worker`` in the store at the last look (all replicas)."""
        return self._store_admitted.get(worker, 0)

    @property
    def pending(self) -> int:
        """Sessions proposed by the core and waiting for the store to confirm them."""
        return len(self._pending)
