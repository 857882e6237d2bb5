"""The admission shell's store side: pending sessions confirmed by the window store, and the
plane's outcomes carried out against it.

With a store that answers over the network (Redis, several replicas) every call is awaited,
and a lock keeps two confirmation passes from interleaving. The in-memory store serves one
replica, whose plane is the only arbiter (as in the simulator): its proposals are confirmed
where it makes them, without a lock, a task or a ranking, and the store records their leases;
an outcome is carried out where the plane decided it (a final call's lease goes back before
its response leaves, not in a task that runs after it).

With Redis, an ended session's store calls (release, dequeue) start where the plane decides
its end, and the saves of session records where they are decided, in tasks that run one after
another per store key; every later call of this replica on that key (a new session of the id
asking, claiming, adopting) waits for them: issued later, an old session's release dropped the
lease of the id's next session (the same replica owns both), and an old record landing after
the id's next admission was written over the new session's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from marsproxy.aimd.admission import AdmissionCore
from marsproxy.aimd.stores import (
    HeldElsewhere,
    MemoryStore,
    WindowRecord,
    WindowStore,
    wall_clock_ms,
)
from marsproxy.core.events import SessionAdmitted
from marsproxy.core.session_record import EndReason
from marsproxy.gateway.shells.admission_types import Granted, Refused
from marsproxy.gateway.shells.held import HeldRequests
from marsproxy.gateway.shells.metrics import GatewayMetrics
from marsproxy.gateway.shells.replicas import Replicas
from marsproxy.gateway.shells.telemetry import Telemetry
from marsproxy.policy.plane import ControlPlane, Ended, Outcome, Pending

log = logging.getLogger("marsproxy.gateway.shells.admission")

# Ends the session's own traffic decided (a final turn, its answer, DELETE): they end it
# wherever its lease is, unfenced. A replica that a session left less than a heartbeat ago
# still holds it here; fenced, such a final turn ended nothing and the new holder kept the
# slot until its idle timeout. Timed ends (idle, evicted) stay fenced.
UNFENCED_ENDS = frozenset({EndReason.FINAL, EndReason.ANSWERED, EndReason.DELETED})


class StoreConfirmations:
    """The part of :class:`~marsproxy.gateway.shells.admission.AdmissionShell` that talks to
    the window store about pending sessions (its base: the state is the shell's)."""

    plane: ControlPlane
    store: WindowStore
    telemetry: Telemetry
    metrics: GatewayMetrics
    replicas: Replicas
    held: HeldRequests
    urls: dict[str, str]
    now: Callable[[], float]
    _windows: dict[str, WindowRecord]
    _store_admitted: dict[str, int]
    _confirm_lock: asyncio.Lock
    _wall_ms_at_zero: int
    _memory: MemoryStore | None
    """The store, when it answers at once (carried out inline, see the module doc)."""
    _tasks: set[asyncio.Task[Any]]
    _store_calls: dict[str, asyncio.Task[None]]
    """Store key -> the last of this replica's store calls on it (an end's, a save), while it
    runs: each starts when the one before is done."""

    @property
    def core(self) -> AdmissionCore:
        return self.plane.admission

    def limit(self, worker: str, idle: bool = False) -> int:
        """The limit the store enforces on ``worker``: the leader's if published, else ours;
        ``idle``: for an idle admission (the core admitted it past the limit, see
        ``AdmissionQueue._idle_admits``), the idle limit."""
        rec = self._windows.get(worker)
        c = self.core.controllers[worker]
        if not idle:
            window = c.effective_limit if rec is None else rec.limit
        elif rec is None:
            window = c.idle_limit
        else:
            window = rec.limit if rec.idle_limit is None else rec.idle_limit
        # The window counts sessions that hold KV room (a slot kept past the KV hold is outside
        # it, as in the core's views); the store counts every lease, also those of this
        # replica's sessions that hold none (a plain client's finished tasks).
        return self.core.slot_limit(worker, window) + self.core.sessions.slotless_on(worker)

    # -- carrying out ---------------------------------------------------------------------
    def _refuse(self, key: str, verdict: Refused) -> None:
        if self.held.refuse(key, verdict):
            self.metrics.rejections.labels(verdict.code).inc()

    def _spawn(self, coro: Any) -> None:
        raise NotImplementedError

    def _refuse_expired(self, out: Outcome) -> None:
        for e in out.expired:
            self._refuse(e.session, Refused(
                e.status, e.reason, e.retry_after_s,
                "no admission slot within the queue deadline" if e.reason == "queue_deadline"
                else "no healthy worker to admit the session"))

    def _answer(self, out: Outcome) -> None:
        """What ``out`` means for held requests, carried out where the plane decided it,
        before any await: a request of a reused id arriving meanwhile is a new session's, and
        neither takes this session's refusal nor hands its grant to this one's requests."""
        self._refuse_expired(out)
        for e in out.ended:
            self._ending(e)
            if self._memory is None:
                self._end_in_store(e)

    def _carry_soon(self, out: Outcome) -> None:
        """Carry out ``out`` from synchronous code: at once on the in-memory store, else the
        store's part in a task (held requests are answered at once, :meth:`_answer`)."""
        self._answer(out)
        if self._memory is not None:
            self._carry_now(out, self._memory)
        else:
            self._spawn(self._carry_answered(out))

    async def _carry(self, out: Outcome) -> None:
        self._answer(out)
        await self._carry_answered(out)

    async def _carry_answered(self, out: Outcome) -> None:
        """The rest of ``out`` once :meth:`_answer` ran: the store, events, confirmations."""
        if self._memory is not None:
            self._carry_now(out, self._memory)
            return
        if out.ended:  # issued by _answer; they come before what follows
            ends = [t for e in out.ended if (t := self._store_calls.get(
                self.replicas.store_key(e.session))) is not None]
            if ends:
                await asyncio.wait(ends)
        # Before the confirmations: session_queued comes first.
        self.telemetry.publish_decided(out.events, self.telemetry.wall() - self.now())
        if self.plane.pending_count:
            await self._confirm_pending()

    def _in_key_order(self, skey: str, calls: Callable[[], Awaitable[None]]) -> None:
        """Runs ``calls()`` in a task once this replica's earlier store calls on ``skey`` are
        done (connections and the script batcher do not keep the order they were issued in)."""
        task = asyncio.ensure_future(_after(self._store_calls.get(skey), calls))
        self._store_calls[skey] = task
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            if self._store_calls.get(skey) is t:
                del self._store_calls[skey]

        task.add_done_callback(done)

    def _end_in_store(self, e: Ended) -> None:
        """Starts ``e``'s store calls now, after the earlier calls on its store key."""
        if e.pending is None and e.worker is None:
            return  # it waited in the local queue only: nothing in the store
        skey = self.replicas.store_key(e.session)
        self._in_key_order(skey, lambda: self._ended(e, skey))

    async def _key_settled(self, skey: str) -> None:
        """Waits for this replica's store calls on ``skey`` still on their way (a cancelled
        waiter leaves them running)."""
        task = self._store_calls.get(skey)
        if task is not None:
            await asyncio.wait([task])

    async def _ended(self, e: Ended, skey: str) -> None:
        if e.pending is not None:
            # The store may have granted it while the answer was lost (a confirmation pass
            # cancelled with its client's request): hand the slot back now, not a TTL later.
            calls = [self.store.dequeue(skey), self.store.release(e.pending.worker, skey)]
        else:
            assert e.worker is not None
            # Fenced: a session another replica took over meanwhile is not ended by a timeout
            # here; its final turn or a DELETE ends it wherever it is.
            calls = [self.store.release(e.worker, skey, any_owner=e.reason in UNFENCED_ENDS)]
        for got in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(got, Exception):
                log.error("ending session %s in the store failed", e.session, exc_info=got)

    def _carry_now(self, out: Outcome, store: MemoryStore) -> None:
        """``_carry_answered`` on the in-memory store: the same steps in the same order, at
        once. What the awaiting path leaves to tasks (a pending session's dequeue and release)
        follows the confirmation pass, as those tasks would."""
        later: list[tuple[str, str]] = []
        for e in out.ended:
            skey = self.replicas.store_key(e.session)
            if e.pending is not None:
                later.append((e.pending.worker, skey))
            elif e.worker is not None:
                store.release_sync(e.worker, skey, any_owner=e.reason in UNFENCED_ENDS)
        if out.events:  # most outcomes on the request path have none: no clocks read
            self.telemetry.publish_decided(out.events, self.telemetry.wall() - self.now())
        if self.plane.pending_count:
            self._confirm_now(store)
        for worker, skey in later:
            store.dequeue_sync(skey)
            store.release_sync(worker, skey)

    def _ending(self, e: Ended) -> None:
        """What a session's end means here before the store hears of it."""
        if self.held.expects(e.session):  # else no request to answer: no refusal built
            self._refuse(e.session, Refused(503, "session_ended", 1,
                                            f"the session ended ({e.reason})"))
        self.replicas.forget(e.session)

    # -- confirmations --------------------------------------------------------------------
    def _arrival_ms(self, p: Pending) -> int:
        # The in-memory store (one replica) scores by arrival alone: one core's order is the
        # policy already, and the simulator's runs stay as they were.
        return self._wall_ms_at_zero + int(p.since * 1000)

    async def _confirm_pending(self) -> None:
        """Ask the store to confirm pending sessions, oldest first."""
        if self._memory is not None:
            self._confirm_now(self._memory)
            return
        async with self._confirm_lock:
            if not self.plane.pending_count:
                return
            store, now_ms = self.store, wall_clock_ms()
            self._store_admitted = await store.admitted_counts(list(self.urls))
            room = {w: max(0, self.limit(w) - n) for w, n in self._store_admitted.items()}
            free = sum(room.values())
            # The policy's order across replicas (lane, class, tenant, arrival): policy/rank.py.
            ranks = self.plane.rank_keys(self.replicas.counters())
            for key, p in self.plane.pending():
                skey = self._relocated(key, room)
                if skey in self._store_calls:  # an ended session of the id leaves first
                    await self._key_settled(skey)
                    if self.plane.pending_of(key) is not p:
                        continue  # it ended meanwhile: its own end withdraws it
                # An idle admission is one slot past the limit, on its idle worker: checked
                # against the idle limit, with one more rank than the free slots allow.
                # The ask also puts it in the global queue when it is not there yet (its first
                # ask, or after a Redis restart), in the same round trip.
                ok = await store.admit_if_ranked(
                    skey, free + 1 if p.idle else free, p.worker, self.limit(p.worker, p.idle),
                    now_ms, ranks[key].score(self._arrival_ms(p)), others=list(self.urls))
                if self.plane.pending_of(key) is not p:  # ended while we asked: undo
                    if ok:
                        await store.release(p.worker, skey)
                    await store.dequeue(skey)
                    continue
                if isinstance(ok, HeldElsewhere):
                    await self._join(key, p, skey, ok.worker)
                elif ok:
                    free -= 1
                    room[p.worker] -= 1
                    self._confirmed(key)
                elif store.mode == "closed":
                    self._store_closed(key)

    def _confirm_now(self, store: MemoryStore) -> None:
        """``_confirm_pending`` on the in-memory store (one replica): the plane is the only
        arbiter, as in the simulator, so its proposals are confirmed at once and the store
        records their leases (for the state document)."""
        if not self.plane.pending_count:
            return
        now_ms = wall_clock_ms()
        for key, p in self.plane.pending():
            store.add_lease(p.worker, self.replicas.store_key(key), now_ms)
            self._confirmed(key)

    def _relocated(self, key: str, room: dict[str, int]) -> str:
        moved = self.plane.relocate(self.now(), key, room)
        if moved is not None:
            log.debug("pending session %s moves to %s", key, moved)
        return self.replicas.store_key(key)

    async def _join(self, key: str, p: Pending, skey: str, worker: str) -> None:
        """Another replica admitted ``key`` on ``worker`` first (the session's first requests
        reached both at once): claim that lease and serve it there, one lease in all. A claim
        that fails (the lease ended meanwhile) leaves it pending for the next pass."""
        if await self.store.claim(worker, skey, wall_clock_ms()):
            log.debug("pending session %s joins its lease on %s", key, worker)
            # Ended while claiming (its id maybe a new session's): nothing is confirmed; the
            # lease, not renewed here, expires, or the new session's next ask joins it.
            if self.plane.pending_of(key) is p:
                self._confirmed(key, worker)

    def _confirmed(self, key: str, worker: str | None = None) -> None:
        p = self.plane.confirm(self.now(), key, worker)
        if p is None:
            return
        waited = max(0.0, self.now() - p.since)
        self.metrics.admission_wait.observe(waited)
        bus = self.telemetry.bus
        if bus.subscribers:
            self.telemetry.publish(SessionAdmitted(ts=self.telemetry.wall(), session=key,
                                                   worker=p.worker, wait_s=waited))
        else:
            bus.skip()  # nobody to read it: not built
        self.held.grant(key, Granted(p.worker, waited, self.plane.incarnation(key)))
        self.replicas.save(key)

    def _store_closed(self, key: str) -> None:
        # on_store_failure: closed — the shared state is unreachable, admit nothing new.
        self._refuse(key, Refused(503, "store_unavailable", 1,
                                  "admission state store unreachable (on_store_failure: closed)"))
        self._carry_soon(self.plane.withdraw(self.now(), key))


async def _after(before: asyncio.Task[None] | None, calls: Callable[[], Awaitable[None]]) -> None:
    if before is not None:
        await asyncio.wait([before])
    await calls()
