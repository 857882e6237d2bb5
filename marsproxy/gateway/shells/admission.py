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

Several replicas, one plane. Every confirmed session has a record in the store (worker,
token counts, attained service, tool-time estimate). A request of a session this replica
does not know loads it and, while its lease is live, *claims* the lease and *adopts* the
session on the same worker (never queued, not a new admission); the replica that held it
finds the lease gone at its next heartbeat and forgets its copy. Ending a session (final
turn, DELETE, idle timeout) drops the lease and the record in one fenced step, so it happens
once, and only the replica that holds the session ends it (a DELETE ends it wherever it is).
Sessions identified by history chaining are per replica (their index is local): their store
keys carry the replica id, so replicas never mix them up, and they are never adopted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp

from marsproxy.aimd.admission import Actions, AdmissionCore, DecisionKind
from marsproxy.aimd.stores import WindowRecord, WindowStore, make_store, wall_clock_ms
from marsproxy.config import MarsConfig
from marsproxy.core.events import Event, Rejected, SessionAdmitted, SessionEnd
from marsproxy.core.lifecycle import EndReason, SessionState
from marsproxy.gateway.http.health import WorkerHealth
from marsproxy.gateway.shells.admission_signals import all_signals
from marsproxy.gateway.shells.admission_tokens import count_tokens
from marsproxy.gateway.shells.admission_types import END_REASONS, Granted, Pending, Refused, Verdict
from marsproxy.gateway.shells.metrics import GatewayMetrics
from marsproxy.gateway.shells.telemetry import Telemetry

log = logging.getLogger("marsproxy.gateway.shells.admission")

class AdmissionShell:
    def __init__(
        self,
        cfg: MarsConfig,
        telemetry: Telemetry,
        health: WorkerHealth,
        metrics: GatewayMetrics,
        store: WindowStore | None = None,
        http: Callable[[], aiohttp.ClientSession | None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.acfg = cfg.admission
        self.telemetry, self.health, self.metrics = telemetry, health, metrics
        self.urls = {w.label: w.url for w in cfg.workers}
        self.core = AdmissionCore(cfg.admission, list(self.urls))
        self.store: WindowStore = store if store is not None else make_store(cfg.store)
        self._http = http  # the upstream client session, for admission.tokenize
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
        # Carried in the session record: tokens served (attained service) and the tool-time
        # estimate of a session adopted from another replica (this one has no history of it).
        self._attained: dict[str, int] = {}
        self._carried_tool_s: dict[str, float] = {}
        self._confirm_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        # Blocks the scheduler's KV ledger reserves per worker label (the gateway wires it).
        self.retained_blocks: Callable[[str], int] = lambda _worker: 0

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
        # Leases are kept, not released: the sessions live on, and their next requests (sent
        # to another replica) adopt them there; those that do not come back expire within
        # one lease TTL, as after a crash. With the memory store they end with the process.
        await self.store.close()

    async def _control_loop(self) -> None:
        while not self._stopping:
            try:
                await self.tick()
            except Exception:  # a failed tick must not stop admission for good
                log.exception("admission tick failed")
            await asyncio.sleep(self.acfg.tuning.control_interval_s)

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
        tel.tool_signal.observe(tel.cpu.latest)
        signals = all_signals(
            pressures, healthy, tel.tool_signal.signals(tel.tracker, tel.wall()),
            tel.cpu_probe.tool_cpus, retained={w: self.retained_blocks(w) for w in self.urls},
            elsewhere={w: self.sessions_elsewhere(w) for w in self.urls},
        )
        return self.core.tick(self.now(), signals)

    async def tick(self) -> None:
        """One control step: core tick, pending deadlines, windows, then carry out."""
        actions = self._signals_now()
        self._forget_lost(actions)
        self._expire_pending(actions)
        store, now_ms = self.store, wall_clock_ms()
        if await store.try_lead(now_ms):
            records = {
                w: WindowRecord(c.effective_limit, c.window, now_ms, idle_limit=c.idle_limit)
                for w, c in self.core.controllers.items()
            }
            await store.publish_windows(records)
        self._windows = await store.read_windows()
        self._store_admitted = await store.admitted_counts(list(self.urls))
        await self._carry(actions)

    def _forget_lost(self, actions: Actions) -> None:
        # Leases this replica held that are gone from the store: another replica took the
        # session over, or ended it (DELETE there), or the lease expired during a stall.
        now = self.now()
        for worker, skey in self.store.drain_lost():
            key = self._core_key(skey)
            if self._held.get(key) != worker:
                continue
            del self._held[key]  # not ours to release any more
            self.telemetry.tracker.session_ended(key)  # its tool phases run elsewhere now
            more = self.core.on_session_end(now, key, EndReason.MOVED)
            actions.admitted += more.admitted
            actions.ended += more.ended
            actions.events += more.events

    # -- store keys and session records ---------------------------------------------------
    @staticmethod
    def shared(key: str) -> bool:
        """Whether ``key`` names the session on every replica (an explicit id)."""
        return key.split("/", 2)[1:2] == ["id"]

    def _store_key(self, key: str) -> str:
        # Chain and anonymous ids are counters of this replica's table: scope them to it.
        return key if self.shared(key) else f"{key}@{self.store.replica_id}"

    def _core_key(self, skey: str) -> str:
        return skey.removesuffix(f"@{self.store.replica_id}")

    @property
    def _replicated(self) -> bool:
        # One replica on the in-process store: nobody else could read a record.
        return self.store.mode != "memory"

    def _save_record(self, key: str) -> None:
        if not self._replicated:
            return
        rec = self.core.sessions.get(key)
        worker = self._held.get(key)
        if rec is None or worker is None:
            return
        usual = self._usual_tool_s(key)
        record: dict[str, Any] = {
            "worker": worker,
            "tenant": rec.tenant,
            "turns": rec.turns,
            "est_tokens": rec.est_tokens,
            "correction": self.core.estimator.correction(key),
            "attained_tokens": self._attained.get(key, 0),
            "usual_tool_s": usual,
            "idle_timeout_s": rec.idle_timeout_s,
            "replica": self.store.replica_id,
        }
        self._spawn(self.store.save_session(self._store_key(key), record))

    def _usual_tool_s(self, key: str) -> float | None:
        usual = self.telemetry.tracker.predicted_duration(key)
        return usual if usual is not None else self._carried_tool_s.get(key)

    async def _adopt(self, key: str, tenant: str, chars: int, final: bool) -> Verdict | None:
        """A session another replica admitted: claim its lease, serve it on its worker."""
        if not self._replicated or not self.shared(key):
            return None
        skey = self._store_key(key)
        rec = await self.store.load_session(skey)
        if rec is None or self.core.sessions.get(key) is not None:
            return None
        worker = rec.get("worker")
        correction = rec.get("correction")
        if isinstance(correction, int | float):
            self.core.estimator.restore(key, float(correction))
        if worker not in self.urls or not await self.store.claim(worker, skey, wall_clock_ms()):
            return None  # its lease is gone (ended, expired): it queues like a new session
        if self.core.sessions.get(key) is not None:
            return None  # another request of it got here first: it is a continuation now
        est = self.core.estimator.estimate(key, chars)
        self.core.on_adopt(self.now(), key, tenant, worker, est, final=final,
                           turns=int(rec.get("turns", 0)))
        self._held[key] = worker
        self._attained[key] = int(rec.get("attained_tokens", 0))
        usual = rec.get("usual_tool_s")
        if isinstance(usual, int | float):
            self._carried_tool_s[key] = float(usual)
        log.debug("adopted session %s on %s from replica %s", key, worker, rec.get("replica"))
        return Granted(worker, 0.0)

    async def _tokenize(self, key: str, chars: int, body: bytes) -> None:
        http = None if self._http is None else self._http()
        healthy = [u for u in self.urls.values() if self.health.is_healthy(u)]
        if http is None or not healthy:
            return
        tokens = await count_tokens(http, healthy[0], body, self.acfg.tuning.tokenize_timeout_s)
        if tokens is not None:
            # As if the worker had reported it: the estimate of this prompt becomes exact.
            self.core.estimator.observe(key, chars, tokens)

    async def end_elsewhere(self, key: str) -> bool:
        """``DELETE`` of a session this replica does not hold: end it in the store, wherever
        it lives (its replica forgets it at its next heartbeat). False: no such session."""
        if key in self._held or self.core.sessions.get(key) is not None:
            self.session_forgotten(key, "deleted")
            return True
        skey = self._store_key(key)
        rec = await self.store.load_session(skey)
        if rec is None:
            return False
        worker = rec.get("worker")
        if worker in self.urls:
            await self.store.release(str(worker), skey, any_owner=True)
        else:
            await self.store.delete_session(skey)
        return True

    def limit(self, worker: str, idle: bool = False) -> int:
        """The limit the store enforces on ``worker``: the leader's if published, else ours;
        ``idle``: for an idle admission (the core admitted it past the limit, see
        ``AdmissionQueue._idle_admits``), the idle limit."""
        rec = self._windows.get(worker)
        c = self.core.controllers[worker]
        if not idle:
            return rec.limit if rec is not None else c.effective_limit
        if rec is None:
            return c.idle_limit
        return rec.limit if rec.idle_limit is None else rec.idle_limit

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
    async def admit(
        self, key: str, tenant: str, chars: int, final: bool, body: bytes | None = None
    ) -> Verdict:
        """Admit a request of session ``key`` now, hold it until admitted, or refuse it.

        ``body`` (the raw request) is only read to count a new session's first prompt with
        ``/tokenize`` when ``admission.tokenize`` is on.
        """
        core = self.core
        if core.sessions.get(key) is None:
            adopted = await self._adopt(key, tenant, chars, final)
            if adopted is not None:
                return adopted
            if body is not None and self.acfg.tokenize:
                await self._tokenize(key, chars, body)
        if key not in self._held and all(v.stale for v in core.views()):
            # Probably the first requests after start: use the first scrape at once.
            await self._carry(self._signals_now())
        now = self.now()
        for w in self.urls:
            core.set_retained(w, self.retained_blocks(w))
        est = core.estimator.estimate(key, chars)
        decision = core.on_request(now, key, tenant, est, final=final)
        if decision.kind is DecisionKind.REJECT:
            await self._carry(decision.actions)
            return self._rejected(decision.reason, decision.retry_after_s)
        if decision.kind is DecisionKind.WAIT:
            self._arrival.setdefault(key, (now, wall_clock_ms()))
        elif decision.reason != "continuation" and decision.worker is not None:
            self._arrival.setdefault(key, (now, wall_clock_ms()))
            self._propose(key, decision.worker, idle=decision.idle)
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

    def response_ended(
        self, key: str, chars: int, prompt_tokens: int | None, completion_tokens: int = 0
    ) -> None:
        """A request that was admitted finished (well or not): its usage corrects estimates."""
        usual = self._usual_tool_s(key)
        actions = self.core.on_response_end(
            self.now(), key, prompt_chars=chars, prompt_tokens=prompt_tokens or None,
            usual_tool_s=usual, completion_tokens=completion_tokens,
        )
        if key in self._held:
            self._attained[key] = (
                self._attained.get(key, 0) + (prompt_tokens or 0) + completion_tokens
            )
        if actions.ended or actions.admitted or actions.events:
            self._spawn(self._carry(actions))
        if not any(k == key for k, _ in actions.ended):
            self._save_record(key)  # another replica may serve its next request

    def session_forgotten(self, key: str, reason: str) -> None:
        """The gateway's session table let ``key`` go (final, idle, evicted, deleted)."""
        end = END_REASONS.get(reason, EndReason.EVICTED)  # unknown: fenced, never elsewhere
        known = self.core.sessions.get(key) is not None
        actions = self.core.on_session_end(self.now(), key, end)
        # The table publishes its own session_end for this one.
        actions.events = [e for e in actions.events if e.session != key]
        if actions.ended or actions.admitted:
            self._spawn(self._carry(actions))
        if end is EndReason.DELETED and not known and self.shared(key):
            self._spawn(self.end_elsewhere(key))  # it moved to another replica: end it there

    # -- carrying out ---------------------------------------------------------------------
    async def _carry(self, actions: Actions) -> None:
        for a in actions.admitted:
            self._propose(a.entry.session, a.worker, idle=a.idle)
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

    def _propose(self, key: str, worker: str, idle: bool = False) -> None:
        arrived = self._arrival.pop(key, None)
        since, ms = arrived if arrived is not None else (self.now(), wall_clock_ms())
        self._pending[key] = Pending(worker, since, ms, idle)

    async def _ended(self, key: str, reason: EndReason) -> None:
        self._arrival.pop(key, None)
        self._refuse(key, Refused(503, "session_ended", 1, f"the session ended ({reason})"))
        self._attained.pop(key, None)
        self._carried_tool_s.pop(key, None)
        if self._drop_pending(key):
            return
        worker = self._held.pop(key, None)
        if worker is not None:
            # Fenced: a session another replica took over meanwhile is not ended by a timeout
            # here; an explicit DELETE ends it wherever it is.
            await self.store.release(worker, self._store_key(key),
                                     any_owner=reason is EndReason.DELETED)

    def _drop_pending(self, key: str) -> bool:
        p = self._pending.pop(key, None)
        if p is None:
            return False
        self._spawn(self.store.dequeue(self._store_key(key)))
        # The store may have granted it while the answer was lost (a confirmation pass
        # cancelled with its client's request): hand the slot back now, not a TTL later.
        self._spawn(self.store.release(p.worker, self._store_key(key)))
        return True

    async def _confirm_pending(self) -> None:
        """Ask the store to confirm pending sessions, oldest first."""
        async with self._confirm_lock:
            if not self._pending:
                return
            store, now_ms = self.store, wall_clock_ms()
            self._store_admitted = await store.admitted_counts(list(self.urls))
            room = {w: max(0, self.limit(w) - n) for w, n in self._store_admitted.items()}
            free = sum(room.values())
            for key, p in sorted(self._pending.items(), key=lambda kv: kv[1].arrival_ms):
                skey = self._store_key(key)
                if room[p.worker] <= 0 and not p.idle:
                    self._relocate(key, p, room)
                # An idle admission is one slot past the limit, on its idle worker: checked
                # against the idle limit, with one more rank than the free slots allow.
                # The ask also puts it in the global queue when it is not there yet (its first
                # ask, or after a Redis restart), in the same round trip.
                ok = await store.admit_if_ranked(
                    skey, free + 1 if p.idle else free, p.worker, self.limit(p.worker, p.idle),
                    now_ms, float(p.arrival_ms))
                if self._pending.get(key) is not p:  # ended while we asked: undo
                    if ok:
                        await store.release(p.worker, skey)
                    await store.dequeue(skey)
                    continue
                if ok:
                    free -= 1
                    room[p.worker] -= 1
                    self._confirmed(key, p)
                elif store.mode == "closed":
                    self._store_closed(key)

    def _relocate(self, key: str, p: Pending, room: dict[str, int]) -> None:
        # Its worker is full across replicas while another has room: move it there (the
        # core checks that it is placeable and that the session's KV fits).
        others = [w for w, n in room.items() if n > 0 and w != p.worker]
        if not others:
            return
        moved = self.core.relocate(self.now(), key, others)
        if moved is not None:
            log.debug("pending session %s moves from %s to %s", key, p.worker, moved)
            p.worker = moved

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
        self._save_record(key)

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
        # The core's clock is monotonic; published events carry wall time, as every other event.
        to_wall = self.telemetry.wall() - self.now()
        for ev in events:
            if isinstance(ev, Rejected | SessionAdmitted):
                continue
            if isinstance(ev, SessionEnd) and ev.reason in (EndReason.FINAL, EndReason.MOVED):
                # FINAL: the session table forgets it next and publishes that end; MOVED: it
                # did not end, another replica serves it now.
                continue
            self.telemetry.publish(replace(ev, ts=ev.ts + to_wall))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- reading (for the state document) -------------------------------------------------
    def sessions_elsewhere(self, worker: str) -> int:
        """Leases on ``worker`` other replicas hold, as of the last look at the store: all
        leases less the sessions this replica holds there (never negative)."""
        mine = sum(1 for w in self._held.values() if w == worker)
        return max(0, self._store_admitted.get(worker, 0) - mine)

    def store_admitted(self, worker: str) -> int:
        """Live leases on ``worker`` in the store at the last look (all replicas)."""
        return self._store_admitted.get(worker, 0)

    @property
    def pending(self) -> int:
        """Sessions proposed by the core and waiting for the store to confirm them."""
        return len(self._pending)
