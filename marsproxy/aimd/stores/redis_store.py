"""The Redis ``WindowStore``: admission state shared by several gateway replicas.

Every check-and-change is one Lua script (see the ``.lua`` files beside this module). Each
replica also mirrors its own leases, queued sessions and session records in a private
:class:`MemoryStore`: that mirror is what it renews by heartbeat, what it keeps admitting
against while Redis is unreachable (``on_store_failure``), and what it writes back on recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence

from marsproxy.aimd.stores.base import (
    ClockMs,
    HeldElsewhere,
    StoreMode,
    WindowRecord,
    wall_clock_ms,
)
from marsproxy.aimd.stores.config import StoreConfig
from marsproxy.aimd.stores.memory import MemoryStore, new_replica_id
from marsproxy.aimd.stores.redis_conn import StoreSetupError
from marsproxy.aimd.stores.redis_errors import StateLost
from marsproxy.aimd.stores.redis_keys import Arg
from marsproxy.aimd.stores.redis_link import FAILURES, RedisLink, raise_if_cancelled
from marsproxy.aimd.stores.redis_records import RedisRecords
from marsproxy.aimd.stores.redis_windows import RedisWindows
from marsproxy.aimd.stores.resync import heartbeat, resync

log = logging.getLogger(__name__)

# Leases per renew script: a long script blocks Redis for every other client meanwhile.
_RENEW_CHUNK = 500


class RedisStore(RedisRecords, RedisWindows):
    """``WindowStore`` over Redis, with the configured fallback while Redis is away."""

    def __init__(
        self,
        config: StoreConfig,
        *,
        clock: ClockMs = wall_clock_ms,
        replica_id: str | None = None,
    ) -> None:
        self.cfg = config
        self.clock = clock
        self._id = replica_id or new_replica_id()
        self.local = MemoryStore(config, clock=clock, replica_id=self._id)
        try:
            self.link = RedisLink(config, self._recover, self.local.fire_local)
        except StoreSetupError as exc:
            raise _config_error(exc) from None
        self.keys, self.scripts, self.redis = self.link.keys, self.link.scripts, self.link.redis
        self.io, self.fail = self.link.io, self.link.fail
        self.lease_ms = round(config.lease_ttl_s * 1000)
        self.session_ms = round(config.session_ttl_s * 1000)
        self._leader_ms = round(config.leader_ttl_s * 1000)
        self.replicas = 1  # last known count of live replicas
        self.epoch: str | None = None  # the pool's as last seen (heartbeat.lua)
        self._lead_until = 0
        self._windows: dict[str, WindowRecord] = {}
        self.workers: set[str] = set()  # every worker touched: resync must visit them
        # Changes made while down, written back on recovery.
        self.q_gone: set[str] = set()
        self.dirty: set[str] = set()
        self.deleted: set[str] = set()
        self.gen = 0  # bumped by every local change while down: resync repeats until stable
        # Leases granted since the heartbeat started: its "gone" answer may predate them.
        self.fresh: set[tuple[str, str]] = set()
        # Leases this replica held and found gone (moved, ended elsewhere, expired): the
        # gateway drains them and forgets those sessions.
        self.lost: list[tuple[str, str]] = []
        self.tomb_ms = self.session_ms
        self._beat_task: asyncio.Task[None] | None = None
        # New sessions wait until then (clock ms): see _recover.
        self._hold_until = 0
        self._hold_end: asyncio.TimerHandle | None = None

    # -- health ---------------------------------------------------------------------------------
    @property
    def replica_id(self) -> str:
        return self._id

    @property
    def up(self) -> bool:
        return self.link.up

    @property
    def mode(self) -> StoreMode:
        return "shared" if self.link.up else self.cfg.on_store_failure

    @property
    def failures_total(self) -> int:
        return self.link.failures_total

    @property
    def is_leader(self) -> bool:
        return self.link.up and self._lead_until > self.clock()

    @property
    def live_replicas(self) -> int:
        return self.replicas

    async def start(self) -> None:
        try:
            await self.link.check()  # a wrong password or CA: refuse to start, say which
        except StoreSetupError as exc:
            await self.link.close()
            raise _config_error(exc) from None
        await self.renew(self.clock())  # registers this replica; a dead Redis starts reconnecting
        self._beat_task = asyncio.create_task(self._beat(), name="redis-store-heartbeat")
        self.link.start()

    async def close(self) -> None:
        if self._hold_end is not None:
            self._hold_end.cancel()
        if self._beat_task is not None:
            self._beat_task.cancel()
            await asyncio.wait([self._beat_task], timeout=1.0)  # bounded: never hang a shutdown
            self._beat_task = None
        await self.link.close()

    async def _beat(self) -> None:
        me = asyncio.current_task()
        assert me is not None
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval_s)
            try:
                await self.renew(self.clock())
            except Exception:  # a missed beat is survivable (lease > 2 beats); a dead loop is not
                log.exception("state store: heartbeat failed")
            raise_if_cancelled(me)

    async def _recover(self) -> str:
        moved = await resync(self)  # still down: ops stay local while this pass runs
        self.link.up = True
        # Another replica may not have re-asserted its leases yet (it notices the outage at its
        # next op), and a failover can have lost its latest grants: a slot that looks free now
        # may be taken. Hold new sessions until it has; waiters re-check when the hold ends.
        hold_s = self.cfg.hold_s
        self._hold_until = self.clock() + round(hold_s * 1000)
        if self._hold_end is not None:
            self._hold_end.cancel()
        self._hold_end = asyncio.get_running_loop().call_later(hold_s, self.local.fire_local)
        # One more pass catches what changed locally during the last one.
        with contextlib.suppress(*FAILURES):
            moved += await resync(self)
        self.local.fire_local()  # waiters re-check against the shared state
        held = sum(len(v) for v in self.local.own_leases().values())
        return f"resynced {held} leases of this replica ({moved} had moved to others)"

    # -- leases ---------------------------------------------------------------------------------
    def _lease_keys(self, worker: str) -> list[str]:
        return [self.keys.adm(worker), self.keys.own(worker)]

    def drain_lost(self) -> list[tuple[str, str]]:
        # The mirror reports leases that expired locally (a stall past the lease TTL) too.
        out, self.lost = self.lost + self.local.drain_lost(), []
        return out

    def _granted(self, worker: str, session: str, now_ms: int) -> None:
        self.local.add_lease(worker, session, now_ms)
        self.fresh.add((worker, session))

    def _open_limit(self, limit: int) -> int:
        # 0 while held after a recovery: the scripts then renew admitted sessions, admit none.
        return 0 if self.clock() < self._hold_until else limit

    def _fallback_admit(self, worker: str, session: str, limit: int, now_ms: int) -> bool:
        self.gen += 1
        mode = self.cfg.on_store_failure
        if mode == "open":
            self.local.add_lease(worker, session, now_ms)
            return True
        # local: this replica's share of the last window; closed: only renew what it holds.
        share = max(1, limit // max(1, self.replicas)) if mode == "local" else 0
        return self.local.admit_sync(worker, session, share, now_ms)

    async def try_admit(self, worker: str, session: str, limit: int, now_ms: int) -> bool:
        self.workers.add(worker)
        if self.link.up:
            args: list[Arg] = [session, self._open_limit(limit), now_ms,
                               now_ms + self.lease_ms, self._id]
            keys = [*self._lease_keys(worker), self.keys.tomb(session)]
            try:
                ok = await self.link.batch.run(self.scripts.admit, keys, args)
            except FAILURES as exc:
                # The script may have run before the reply was lost: that lease is nobody's
                # to renew and expires within one lease TTL.
                self.fail(exc)
            else:
                if ok:
                    self._granted(worker, session, now_ms)
                return bool(ok)
        return self._fallback_admit(worker, session, limit, now_ms)

    async def claim(self, worker: str, session: str, now_ms: int) -> bool:
        if not self.link.up:
            return False  # whose lease it is cannot be known: the session queues anew here
        args: list[Arg] = [session, 0, now_ms, now_ms + self.lease_ms, self._id]
        keys = [*self._lease_keys(worker), self.keys.tomb(session)]
        try:
            ok = await self.link.batch.run(self.scripts.admit, keys, args)
        except FAILURES as exc:
            self.fail(exc)
            return False
        if ok:
            self.workers.add(worker)
            self._granted(worker, session, now_ms)
        return bool(ok)

    async def release(self, worker: str, session: str, *, any_owner: bool = False) -> bool:
        mine = self.local.drop_lease(worker, session)  # first: resync reconciles a failure
        if self.link.up:
            args: list[Arg] = [session, self.keys.channel, "" if any_owner else self._id,
                               self.tomb_ms]
            keys = [*self._lease_keys(worker), self.keys.queue, self.keys.session(session),
                    self.keys.tomb(session)]
            try:
                n = await self.link.batch.run(self.scripts.release, keys, args)
            except FAILURES as exc:
                self.fail(exc)
            else:
                await self.local.delete_session(session)
                return int(n) > 0
        await self.delete_session(session)  # written back (deleted) on recovery
        if mine:
            self.q_gone.add(session)  # as release.lua: an admitted session waits nowhere
        self.gen += 1
        self.local.fire_local()
        return mine

    async def renew(self, now_ms: int) -> int:
        self.fresh.clear()
        own = {w: ss for w, ss in self.local.own_leases().items() if ss}
        renewed = self.local.renew_sync(now_ms)
        if not self.link.up:
            return renewed
        expiry = now_ms + self.lease_ms
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                await heartbeat(self, pipe, now_ms, expiry)
                chunks = [(w, ss[i : i + _RENEW_CHUNK]) for w, ss in own.items()
                          for i in range(0, len(ss), _RENEW_CHUNK)]
                for w, chunk in chunks:
                    args: list[Arg] = [now_ms, expiry, self._id, *chunk]
                    await self.scripts.renew(keys=self._lease_keys(w), args=args, client=pipe)
                results = await self.io(pipe.execute())
        except FAILURES as exc:
            self.fail(exc)
            return renewed
        replicas, epoch = results[0]
        if self.epoch not in (None, epoch):
            # Redis restarted empty (or a failover lost the pool) and no op of this replica
            # failed meanwhile: its "gone" answers are not releases. As after an outage, the
            # resync writes its leases back (and takes the new epoch).
            self.fail(StateLost(f"the pool's state is gone (epoch {self.epoch} is now {epoch})"))
            return renewed
        self.epoch, self.replicas = epoch, int(replicas)
        lost = 0
        for (w, _), gone in zip(chunks, results[1:], strict=True):
            for s in gone:
                # Released elsewhere, moved, or expired.
                if (w, s) not in self.fresh and self.local.drop_lease(w, s):
                    lost += 1
                    self.lost.append((w, s))
        if lost:
            # Usually a session that moved to another replica; after a stall longer than
            # lease_ttl_s it is a slot that was reaped and may have been given away.
            log.info("state store: %d leases of this replica are gone from Redis", lost)
        return sum(len(ss) for ss in own.values()) - lost

    async def admitted(self, worker: str) -> int:
        if self.link.up:
            try:
                key, low = self.keys.adm(worker), f"({self.clock()}"
                return await self.io(self.redis.zcount(key, low, "+inf"))
            except FAILURES as exc:
                self.fail(exc)
        return self.local.own_count(worker)

    async def admitted_counts(self, workers: Sequence[str]) -> dict[str, int]:
        if self.link.up:
            low = f"({self.clock()}"
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for w in workers:
                        pipe.zcount(self.keys.adm(w), low, "+inf")
                    counts = await self.io(pipe.execute())
                return {w: int(n) for w, n in zip(workers, counts, strict=True)}
            except FAILURES as exc:
                self.fail(exc)
        return {w: self.local.own_count(w) for w in workers}

    async def admitted_sessions(self, worker: str) -> list[str]:
        if self.link.up:
            key, now = self.keys.adm(worker), self.clock()
            try:
                got = await self.io(self.redis.zrange(key, f"({now}", "+inf", byscore=True))
                return sorted(str(s) for s in got)
            except FAILURES as exc:
                self.fail(exc)
        return sorted(self.local.own_leases().get(worker, []))

    # -- global queue (enqueue, dequeue, rank, length: RedisRecords) ------------------------
    async def admit_if_ranked(
        self, session: str, free_slots: int, worker: str, limit: int, now_ms: int,
        score: float | None = None, others: Sequence[str] = (),
    ) -> bool | HeldElsewhere:
        self.workers.add(worker)
        if score is not None:  # (re-)scored: the mirror, for resync and local mode
            self.local.enqueue_sync(session, score)
            self.q_gone.discard(session)
        if self.link.up:
            keys = self.keys.ranked(worker, session, others)
            args: list[Arg] = [session, free_slots, self._open_limit(limit), now_ms,
                               now_ms + self.lease_ms, self._id, "" if score is None else score]
            try:
                got = await self.link.batch.run(self.scripts.admit_ranked, keys, args)
            except FAILURES as exc:
                self.fail(exc)
            else:
                if isinstance(got, str):  # the lease key of the worker that holds it
                    self.local.dequeue_sync(session)
                    return HeldElsewhere(self.keys.worker_of(got))
                if got:
                    self._granted(worker, session, now_ms)
                    self.local.dequeue_sync(session)
                return bool(got)
        self.gen += 1
        mode = self.cfg.on_store_failure
        share = max(1, limit // max(1, self.replicas))
        # Asked before admitting: the local admission takes the session out of the queue.
        queued = self.local.rank_sync(session) is not None
        if mode == "local":
            ok = self.local.admit_ranked_sync(session, free_slots, worker, share, now_ms)
        else:
            ok = self._fallback_admit(worker, session, limit, now_ms)
        if ok and queued:
            self.local.dequeue_sync(session)
            self.q_gone.add(session)  # resync removes its Redis queue entry
        return ok

    # -- wake-ups -------------------------------------------------------------------------------
    async def notify(self) -> None:
        if self.link.up:
            try:
                await self.io(self.redis.publish(self.keys.channel, "notify"))
                return  # our own subscription delivers it here too
            except FAILURES as exc:
                self.fail(exc)
        self.local.fire_local()

    def wakeups(self) -> AsyncGenerator[None, None]:
        return self.local.wakeups()


def _config_error(exc: StoreSetupError) -> Exception:
    # Imported here: marsproxy.config imports this package (its StoreConfig) at load time.
    from marsproxy.config import ConfigError

    return ConfigError(f"store: {exc}")
