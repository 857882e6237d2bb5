"""The admission shell: feeds the pure ``AdmissionCore`` and carries out what it decides.

The core decides (window, queue order, KV fit, idle timeouts, deadlines); this shell only
feeds it events (requests, response ends, session ends, control ticks with the latest
signals, a timer at the plane's next deadline) and carries out its actions: wake held
requests, answer expired ones, publish events, release leases.

Core ↔ store. The local core proposes every admission. With the in-memory store (one replica)
the proposal is final and the store only keeps the lease. With several replicas sharing one
Redis the ``WindowStore`` confirms it, the arbiter of the global count: a proposed session is
*pending*: the core already counts it on its worker (so this replica proposes no
more than its limit there), its request stays held, and it sits in the store's global queue
scored by its arrival time. It is confirmed with ``admit_if_ranked`` (rank below the free slots
of all workers, and room on its worker under the published limit), retried on every control
tick and every store wake-up, and answered 503 when its queue deadline passes first. Sessions
the core itself holds back (WAIT) stay out of the global queue: they wait for local reasons,
and counting them there would block the pending ones behind them.

Several replicas share the plane's counts through the store; the session records that let a
replica adopt another's session are :mod:`marsproxy.gateway.shells.replicas`. Every decision
(what to propose, relocate, expire or end) is the control plane's
(:mod:`marsproxy.policy.plane`); this shell keeps the I/O: held requests, store calls, events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from marsproxy.aimd.admission import DecisionKind
from marsproxy.aimd.stores import MemoryStore, WindowRecord, WindowStore, make_store, wall_clock_ms
from marsproxy.config import MarsConfig
from marsproxy.core.session_record import EndReason
from marsproxy.gateway.http.health import WorkerHealth
from marsproxy.gateway.shells.admission_tokens import first_prompt_tokens
from marsproxy.gateway.shells.admission_types import QUEUE_REFUSALS, Granted, Refused, Verdict
from marsproxy.gateway.shells.confirm import StoreConfirmations
from marsproxy.gateway.shells.deadlines import Alarm
from marsproxy.gateway.shells.held import HeldRequests
from marsproxy.gateway.shells.metrics import GatewayMetrics
from marsproxy.gateway.shells.observations import observations
from marsproxy.gateway.shells.replicas import Replicas, ReplyLink
from marsproxy.gateway.shells.telemetry import Telemetry
from marsproxy.policy.observe import WorkerObservation
from marsproxy.policy.plane import ControlPlane, Outcome

log = logging.getLogger("marsproxy.gateway.shells.admission")


class AdmissionShell(StoreConfirmations):
    def __init__(
        self,
        cfg: MarsConfig,
        plane: ControlPlane,
        telemetry: Telemetry,
        health: WorkerHealth,
        metrics: GatewayMetrics,
        store: WindowStore | None = None,
        http: Callable[[], aiohttp.ClientSession | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.acfg = cfg.admission
        self.plane = plane
        self.telemetry, self.health, self.metrics = telemetry, health, metrics
        self.urls = {w.label: w.url for w in cfg.workers}
        self.store: WindowStore = store if store is not None else make_store(cfg.store)
        self.now = clock
        """The clock fed to the plane (the gateway's: monotonic seconds)."""
        # The store scores the global queue by wall-clock arrival (comparable across replicas).
        self._wall_ms_at_zero = wall_clock_ms() - int(self.now() * 1000)
        self._http = http  # the upstream client session, for admission.tokenize
        self.held = HeldRequests()
        self._closing = False
        self._stopping = False
        self._tick_now = asyncio.Event()  # a control tick before the period is over
        self._windows: dict[str, WindowRecord] = {}  # as published by the leader
        self._store_admitted: dict[str, int] = dict.fromkeys(self.urls, 0)
        self._confirm_lock = asyncio.Lock()
        self._memory = self.store if isinstance(self.store, MemoryStore) else None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._store_calls: dict[str, asyncio.Task[None]] = {}
        self._loops: list[asyncio.Task[None]] = []
        # The plane's next hold end while sessions wait (next_deadline): expire_now then.
        self._expiry = Alarm(self.expire_now)
        self.replicas = Replicas(plane, self.store, telemetry.tracker, self._in_key_order,
                                 self.now)
        self.observe: Callable[[], dict[str, WorkerObservation]] = lambda: observations(
            cfg.workers, telemetry, health)
        """What the plane hears about the workers at a tick (the probes; a test may script it)."""

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
        for key in self.held.waiting():
            self._refuse(key, Refused(503, "shutting_down", 1, "the proxy is shutting down"))

    async def stop(self) -> None:
        self._stopping = True
        self._expiry.cancel()
        tasks = [*self._loops, *self._tasks]
        for t in tasks:
            t.cancel()
        if tasks:
            # Bounded: a cancel that a store call swallowed (e.g. turned into a timeout) must
            # not hang the shutdown; the loops also stop on the flag at their next turn.
            await asyncio.wait(tasks, timeout=2.0)
        self._loops, self._tasks = [], set()
        # Leases are kept, not released: the sessions live on, and their next requests (sent
        # to another replica) adopt them there; those that do not come back expire within
        # one lease TTL, as after a crash. With the memory store they end with the process.
        await self.store.close()

    async def _control_loop(self) -> None:
        while not self._stopping:
            self._tick_now.clear()  # before the tick: a wake-up during it ticks again at once
            try:
                await self.tick()
            except Exception:  # a failed tick must not stop admission for good
                log.exception("admission tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._tick_now.wait(), self.acfg.tuning.control_interval_s)

    def scraped(self) -> None:
        """A worker was scraped. Requests held because nothing was known of any worker yet
        (the first ones after start, before the first scrape landed) are decided now, not up
        to a control period later."""
        if self.plane.admission.all_stale() and self.held.waiting():
            self._tick_now.set()

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
    def _plane_tick(self) -> Outcome:
        tel = self.telemetry
        return self.plane.tick(self.now(), self.observe(), at=tel.wall(), cpu=tel.cpu.latest,
                               elsewhere={w: self.sessions_elsewhere(w) for w in self.urls})

    async def tick(self) -> None:
        """One control step: leases lost, the plane's tick, windows, then carry out. Held
        requests are answered as each decision is made (``_answer``), not after the store
        calls between: an id reused meanwhile is a new session's."""
        out = Outcome()
        for worker, skey in self.store.drain_lost():
            out.extend(self._decided(self.plane.lost(self.now(), self.replicas.core_key(skey),
                                                     worker)))
        store = self.store  # fresh counts first: the plane counts other replicas' from them
        self._store_admitted = await store.admitted_counts(list(self.urls))
        if self.replicas.on:  # the tenants' shared counters, before the queue's next passes
            await self.replicas.exchange_counters()
        out.extend(self._decided(self._plane_tick()))
        now_ms = wall_clock_ms()
        if await store.try_lead(now_ms):
            # Not for a worker not seen yet: its floor would bind every replica until the next
            # tick; without a record each replica goes by its own controller (seen at once).
            records = {
                w: WindowRecord(c.effective_limit, c.window, now_ms, idle_limit=c.idle_limit)
                for w, c in self.core.controllers.items() if c.seen
            }
            if records:  # an empty set reads as "keep the last" (read_windows)
                await store.publish_windows(records)
        self._windows = await store.read_windows()
        await self._carry_answered(out)
        self._arm()

    def _arm(self) -> None:
        """Time :meth:`expire_now` for the plane's next deadline (a KV hold ends while sessions
        wait); only while the shell runs (started: a replay expires by itself)."""
        if self._loops and not self._stopping:
            self._expiry.arm(self.plane.next_deadline(), self.now())

    def expire_now(self) -> None:
        """The holds due end: who waits for their room is let in now, not at the next tick."""
        if (at := self.plane.next_deadline()) is not None and at <= self.now():
            self._carry_soon(self.plane.expire(self.now()))
        self._arm()

    def _decided(self, out: Outcome) -> Outcome:
        self._answer(out)
        return out

    async def end_elsewhere(self, key: str) -> bool:
        """``DELETE`` of a session this replica does not hold: end it in the store, wherever
        it lives (its replica forgets it at its next heartbeat). False: no such session."""
        if self.plane.held(key) is not None or self.core.sessions.get(key) is not None:
            self.session_forgotten(key, EndReason.DELETED)
            return True
        return await self.replicas.end_elsewhere(key)

    # -- the request path -----------------------------------------------------------------
    async def admit(
        self, key: str, tenant: str, chars: int, final: bool, body: bytes | None = None,
        tokens: int | None = None, cls: str | None = None,
        prefix: dict[str, int] | None = None, parent: str | None = None,
        reply: ReplyLink | None = None,
    ) -> Verdict:
        """Admit a request of session ``key`` now, hold it until admitted, or refuse it.

        ``body`` (the raw request) is only read to count a new session's first prompt with
        ``/tokenize`` when ``admission.tokenize`` is on; ``tokens``: its size when known;
        ``cls``: its service class (the x-session-class header's, or the tenant's);
        ``reply``: the reply it continues (another replica may hold its session; only the
        reply's worker keeps it).
        """
        core = self.core
        if core.sessions.get(key) is None:
            if self._store_calls:  # the id's ended session leaves the store before it is read
                await self._key_settled(self.replicas.store_key(key))
            adopted = await self.replicas.adopt(key, tenant, chars, final,
                                                by_reply=reply is not None and reply.key == key)
            if adopted is not None:
                return Granted(adopted, 0.0, self.plane.incarnation(key))
            if body is not None and self.acfg.tokenize:
                http = None if self._http is None else self._http()
                healthy = [u for u in self.urls.values() if self.health.is_healthy(u)]
                tokens = await first_prompt_tokens(http, healthy, body,
                                                   self.acfg.tuning.tokenize_timeout_s)
                if tokens is not None:  # as if the worker had reported it: exact
                    self.plane.estimator.observe(key, chars, tokens)
        elsewhere = core.sessions.get(key) is None and await self.replicas.parent_elsewhere(parent)
        if self.plane.wants_tick(key):  # the first requests after start: scrape at once
            await self._carry(self._plane_tick())
        ans = self.plane.request(self.now(), key, tenant, chars=chars, tokens=tokens,
                                 final=final, cls=cls, prefix=prefix, parent=parent,
                                 parent_elsewhere=elsewhere,
                                 bound=None if reply is None else reply.worker)
        self._arm()  # it may wait for a hold's end
        if ans.kind is DecisionKind.REJECT:
            await self._carry(ans.outcome)
            return self._rejected(ans.reason, ans.retry_after_s)
        self.held.arriving(key, ans.incarnation)
        try:
            await self._carry(ans.outcome)
        except asyncio.CancelledError:
            self._abandon(key, None, ans.incarnation)  # it left before its request could wait
            raise
        finally:
            early = self.held.arrived(key, ans.incarnation)
        if self.plane.incarnation(key) != ans.incarnation:
            # Its session ended while this request was on its way (the id may name a new one
            # by now, whose slot is not this request's).
            early = early or Refused(503, "session_ended", 1,
                                     "the session ended before it was admitted")
        elif (worker := self.plane.held(key)) is not None:
            # Confirmed, now or long ago (it may have waited a pass above).
            return Granted(worker, 0.0, ans.incarnation)
        if early is not None:
            self.metrics.rejections.labels(early.code).inc()
            return early
        return await self._hold(key, ans.incarnation)

    async def _hold(self, key: str, incarnation: int | None) -> Verdict:
        if self._closing:
            return Refused(503, "shutting_down", 1, "the proxy is shutting down")
        fut = self.held.future(key)
        try:
            return await fut
        except asyncio.CancelledError:
            self._abandon(key, fut, incarnation)
            raise

    def _abandon(self, key: str, fut: asyncio.Future[Verdict] | None,
                 incarnation: int | None) -> None:
        """A held client went away; the session ends if nobody else waits for it.
        ``incarnation``: the session its request joined."""
        if fut is not None and fut.done() and not fut.cancelled() and isinstance(
            fut.result(), Granted
        ):
            # Admitted just before the client left: the request counts as served.
            self.served_nothing(key, incarnation)
            return
        if self.plane.incarnation(key) != incarnation:
            return  # its session ended: the id's next session is not this request's to end
        if self.held.others(key, fut, incarnation):  # the session waits on for them
            self.plane.waiter_left(key)
            return
        if self.plane.held(key) is not None:
            if fut is None:  # it was counted in flight and will not be served: uncount it
                self.served_nothing(key, incarnation)
            return
        self._carry_soon(self.plane.withdraw(self.now(), key))

    def served_nothing(self, key: str, incarnation: int | None) -> None:
        """An admitted request that never went upstream: it ends as served, without usage."""
        end = self.plane.call_end(self.now(), key, None, incarnation=incarnation, ok=False,
                                  admitted=True, prompt_tokens=None)
        self.call_ended(key, end.outcome, 0)

    def call_ended(self, key: str, out: Outcome, served_tokens: int) -> None:
        """A request that was admitted finished (well or not); ``out``: what the plane
        decided of it (the end of a final call ends the session)."""
        self.replicas.served(key, served_tokens)
        if out:
            self._carry_soon(out)
        self._arm()  # its KV hold begins
        if self.replicas.on and not any(e.session == key for e in out.ended):
            self.replicas.save(key)  # another replica may serve its next request

    def session_forgotten(self, key: str, end: EndReason) -> Outcome:
        """The gateway's session table let ``key`` go (final, idle, evicted, deleted)."""
        known = self.core.sessions.get(key) is not None
        out = self.plane.session_end(self.now(), key, end)
        # The table publishes its own session_end for this one.
        out.events = [e for e in out.events if e.session != key]
        if out:
            self._carry_soon(out)
        if end is EndReason.DELETED and not known and self.replicas.shared(key):
            self._spawn(self.end_elsewhere(key))  # it moved to another replica: end it there
        return out

    # -- carrying out ---------------------------------------------------------------------
    def _rejected(self, reason: str, retry: int | None) -> Refused:
        self.metrics.rejections.labels(reason).inc()
        message = QUEUE_REFUSALS.get(reason, QUEUE_REFUSALS["queue_full"])
        return Refused(429, reason, retry or 1, message)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- reading (for the state document) -------------------------------------------------
    def sessions_elsewhere(self, worker: str) -> int:
        """Leases on ``worker`` other replicas hold, as of the last look at the store: all
        leases less the sessions this replica holds there (never negative; none with the
        in-process store, which no other replica shares)."""
        if not self.replicas.on:
            return 0
        return max(0, self._store_admitted.get(worker, 0) - self.plane.held_on(worker))

    def store_admitted(self, worker: str) -> int:
        """Live leases on ``worker`` in the store at the last look (all replicas)."""
        return self._store_admitted.get(worker, 0)

    @property
    def pending(self) -> int:
        """Sessions proposed by the core and waiting for the store to confirm them."""
        return self.plane.pending_count
