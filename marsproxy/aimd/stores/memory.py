"""The in-memory ``WindowStore``: the default, for a single replica.

It has the same lease, leader and queue semantics as the Redis store (an injected clock drives
lease expiry), so tests can share one ``MemoryState`` between several instances to play
several replicas. The gateway of one replica keeps its leases (never expiring, see ``lone``)
and windows here; its plane's admissions need no confirmation, so it never ranks here. The
Redis store also keeps one of these per replica as its mirror of its own leases and its
fallback while Redis is down.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from marsproxy.aimd.stores.base import (
    ClockMs,
    HeldElsewhere,
    StoreMode,
    WakeupHub,
    WindowRecord,
    wall_clock_ms,
)
from marsproxy.aimd.stores.config import StoreConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Lease:
    expiry_ms: int
    owner: str


@dataclass
class MemoryState:
    """Everything one pool holds; share one between instances to emulate several replicas."""

    leases: dict[str, dict[str, Lease]] = field(default_factory=dict)  # worker → session → lease
    leader: tuple[str, int] | None = None  # (replica, expiry_ms)
    windows: dict[str, WindowRecord] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)  # queued session → score
    order: list[tuple[float, str]] = field(default_factory=list)  # sorted like a Redis ZSET
    replicas: dict[str, int] = field(default_factory=dict)  # replica → heartbeat expiry_ms
    sessions: dict[str, tuple[int, str]] = field(default_factory=dict)  # key → (expiry, json)
    replies: dict[str, tuple[int, str]] = field(default_factory=dict)  # reply → (expiry, entry)
    tenants: dict[str, float] = field(default_factory=dict)  # tenant → virtual token counter
    hub: WakeupHub = field(default_factory=WakeupHub)


def new_replica_id() -> str:
    return secrets.token_hex(6)


class MemoryStore:
    """``WindowStore`` over a ``MemoryState`` (a private one unless given).

    ``lone``: the store of a replica that shares it with nobody (``store.backend: memory``).
    Its leases never expire: expiry is how another replica takes a session over, and a lone
    replica whose event loop stalled past ``lease_ttl_s`` would otherwise end every session it
    holds at its next heartbeat.
    """

    def __init__(
        self,
        config: StoreConfig,
        *,
        clock: ClockMs = wall_clock_ms,
        state: MemoryState | None = None,
        replica_id: str | None = None,
        lone: bool = False,
    ) -> None:
        self._cfg = config
        self._lone = lone
        self._clock = clock
        self._s = state if state is not None else MemoryState()
        self._id = replica_id or new_replica_id()
        self._lease_ms = round(config.lease_ttl_s * 1000)
        self._leader_ms = round(config.leader_ttl_s * 1000)
        self._heartbeat: asyncio.Task[None] | None = None
        # Leases this instance granted itself; one found gone or owned by another replica at
        # a heartbeat is reported once by drain_lost().
        self._mine: set[tuple[str, str]] = set()
        self._lost: list[tuple[str, str]] = []

    # -- health ---------------------------------------------------------------------------------
    @property
    def replica_id(self) -> str:
        return self._id

    @property
    def up(self) -> bool:
        return True

    @property
    def mode(self) -> StoreMode:
        return "memory"

    @property
    def failures_total(self) -> int:
        return 0

    @property
    def is_leader(self) -> bool:
        lead = self._s.leader
        return lead is not None and lead[0] == self._id and lead[1] > self._clock()

    @property
    def live_replicas(self) -> int:
        now = self._clock()
        return max(1, sum(1 for exp in self._s.replicas.values() if exp > now))

    async def start(self) -> None:
        self._s.replicas[self._id] = self._clock() + self._lease_ms
        self._heartbeat = asyncio.create_task(self._beat(), name="memory-store-heartbeat")

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._cfg.heartbeat_interval_s)
            self.renew_sync(self._clock())

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None

    # -- leases ---------------------------------------------------------------------------------
    def _reap(self, worker: str, now_ms: int) -> dict[str, Lease]:
        held = self._s.leases.setdefault(worker, {})
        if self._lone:
            return held
        dead = [s for s, lease in held.items() if lease.expiry_ms <= now_ms]
        for s in dead:
            del held[s]
        return held

    def admit_sync(self, worker: str, session: str, limit: int, now_ms: int) -> bool:
        held = self._reap(worker, now_ms)
        lease = held.get(session)
        if lease is None and len(held) >= limit:
            return False
        held[session] = Lease(now_ms + self._lease_ms, self._id)
        self._mine.add((worker, session))
        return True

    async def try_admit(self, worker: str, session: str, limit: int, now_ms: int) -> bool:
        return self.admit_sync(worker, session, limit, now_ms)

    def add_lease(self, worker: str, session: str, now_ms: int) -> None:
        """Record a lease granted elsewhere (the Redis store mirrors its own leases here)."""
        self._s.leases.setdefault(worker, {})[session] = Lease(now_ms + self._lease_ms, self._id)
        self._mine.add((worker, session))

    def drop_lease(self, worker: str, session: str) -> bool:
        self._mine.discard((worker, session))
        return self._s.leases.get(worker, {}).pop(session, None) is not None

    async def claim(self, worker: str, session: str, now_ms: int) -> bool:
        return self.admit_sync(worker, session, 0, now_ms)

    async def release(self, worker: str, session: str, *, any_owner: bool = False) -> bool:
        return self.release_sync(worker, session, any_owner=any_owner)

    def release_sync(self, worker: str, session: str, *, any_owner: bool = False) -> bool:
        lease = self._s.leases.get(worker, {}).get(session)
        if lease is not None and lease.owner != self._id and not any_owner:
            self._mine.discard((worker, session))
            return False  # it moved to another replica, which serves it now
        dropped = self.drop_lease(worker, session)
        self._s.sessions.pop(session, None)
        if dropped and self._s.order:  # as release.lua does
            self._s.hub.fire()
        return dropped

    def drain_lost(self) -> list[tuple[str, str]]:
        out, self._lost = self._lost, []
        return out

    def renew_sync(self, now_ms: int) -> int:
        self._s.replicas[self._id] = now_ms + self._lease_ms
        # Purge here: records of sessions that never come back would otherwise stay forever.
        dead = [k for k, (exp, _) in self._s.sessions.items() if exp <= now_ms]
        for k in dead:
            del self._s.sessions[k]
        renewed = 0
        for worker in list(self._s.leases):
            for lease in self._reap(worker, now_ms).values():
                if lease.owner == self._id:
                    lease.expiry_ms = now_ms + self._lease_ms
                    renewed += 1
        for worker, session in list(self._mine):
            got = self._s.leases.get(worker, {}).get(session)
            if got is None or got.owner != self._id:
                self._mine.discard((worker, session))
                self._lost.append((worker, session))
        return renewed

    async def renew(self, now_ms: int) -> int:
        return self.renew_sync(now_ms)

    def own_leases(self) -> dict[str, list[str]]:
        """This replica's leases by worker, expired ones included (resync decides)."""
        return {
            w: [s for s, lease in held.items() if lease.owner == self._id]
            for w, held in self._s.leases.items()
        }

    def own_count(self, worker: str) -> int:
        held = self._s.leases.get(worker, {})
        return sum(1 for lease in held.values() if lease.owner == self._id)

    def _live(self, worker: str) -> list[str]:
        if self._lone:
            return list(self._s.leases.get(worker, {}))
        now = self._clock()
        return [s for s, lease in self._s.leases.get(worker, {}).items() if lease.expiry_ms > now]

    async def admitted(self, worker: str) -> int:
        return len(self._live(worker))

    async def admitted_counts(self, workers: Sequence[str]) -> dict[str, int]:
        return self.admitted_counts_sync(workers)

    def admitted_counts_sync(self, workers: Sequence[str]) -> dict[str, int]:
        return {w: len(self._live(w)) for w in workers}

    async def admitted_sessions(self, worker: str) -> list[str]:
        return sorted(self._live(worker))

    # -- leader and windows ---------------------------------------------------------------------
    async def try_lead(self, now_ms: int) -> bool:
        lead = self._s.leader
        if lead is None or lead[0] == self._id or lead[1] <= now_ms:
            self._s.leader = (self._id, now_ms + self._leader_ms)
            return True
        return False

    def set_windows(self, windows: Mapping[str, WindowRecord]) -> None:
        self._s.windows = dict(windows)

    async def publish_windows(self, windows: Mapping[str, WindowRecord]) -> bool:
        if not self.is_leader:
            return False
        self.set_windows(windows)
        return True

    async def read_windows(self) -> dict[str, WindowRecord]:
        return dict(self._s.windows)

    # -- global queue ---------------------------------------------------------------------------
    def enqueue_sync(self, session: str, score: float) -> None:
        self.dequeue_sync(session)
        self._s.scores[session] = score
        bisect.insort(self._s.order, (score, session))

    async def enqueue(self, session: str, score: float) -> None:
        self.enqueue_sync(session, score)

    def dequeue_sync(self, session: str) -> bool:
        old = self._s.scores.pop(session, None)
        if old is None:
            return False
        i = bisect.bisect_left(self._s.order, (old, session))
        del self._s.order[i]
        return True

    async def dequeue(self, session: str) -> None:
        self.dequeue_sync(session)

    def rank_sync(self, session: str) -> int | None:
        score = self._s.scores.get(session)
        return None if score is None else bisect.bisect_left(self._s.order, (score, session))

    async def queue_rank(self, session: str) -> int | None:
        return self.rank_sync(session)

    async def queue_len(self) -> int:
        return len(self._s.order)

    def queue_items(self) -> list[tuple[str, float]]:
        return [(s, score) for score, s in self._s.order]

    def admit_ranked_sync(
        self, session: str, free_slots: int, worker: str, limit: int, now_ms: int,
        score: float | None = None,
    ) -> bool:
        rank = self.rank_sync(session)
        if rank is None:  # not waiting: an already admitted session passes
            held = self._reap(worker, now_ms)
            if session in held:
                return self.admit_sync(worker, session, limit, now_ms)
            if score is None:
                return False
            self.enqueue_sync(session, score)  # as admit_ranked.lua: join, then rank
            rank = self.rank_sync(session)
            assert rank is not None
        if rank >= free_slots or not self.admit_sync(worker, session, limit, now_ms):
            return False
        self.dequeue_sync(session)
        return True

    async def admit_if_ranked(
        self, session: str, free_slots: int, worker: str, limit: int, now_ms: int,
        score: float | None = None, others: Sequence[str] = (),
    ) -> bool | HeldElsewhere:
        if session not in self._reap(worker, now_ms):  # as admit_ranked.lua
            for w in others:
                if w != worker and session in self._reap(w, now_ms):
                    self.dequeue_sync(session)
                    return HeldElsewhere(w)
        return self.admit_ranked_sync(session, free_slots, worker, limit, now_ms, score)

    # -- wake-ups -------------------------------------------------------------------------------
    async def exchange_counters(self, charges: Mapping[str, float]) -> dict[str, float] | None:
        for tenant, c in charges.items():
            self._s.tenants[tenant] = self._s.tenants.get(tenant, 0.0) + c
        return dict(self._s.tenants)

    async def notify(self) -> None:
        self._s.hub.fire()

    def fire_local(self) -> None:
        self._s.hub.fire()

    def wakeups(self) -> AsyncGenerator[None, None]:
        return self._s.hub.stream()

    # -- session records ------------------------------------------------------------------------
    def save_raw(self, key: str, raw: str) -> None:
        self._s.sessions[key] = (self._clock() + round(self._cfg.session_ttl_s * 1000), raw)

    async def save_session(self, key: str, record: Mapping[str, Any]) -> None:
        lease = self._s.leases.get(str(record.get("worker")), {}).get(key)
        if lease is not None and lease.owner != self._id:
            return  # another replica holds it: its record stands (as save.lua)
        # Stored as JSON, like Redis does: the caller's dict can change without touching it.
        self.save_raw(key, json.dumps(record, separators=(",", ":")))

    def load_raw(self, key: str) -> str | None:
        hit = self._s.sessions.get(key)
        if hit is None:
            return None
        if hit[0] <= self._clock():
            del self._s.sessions[key]
            return None
        return hit[1]

    async def load_session(self, key: str) -> dict[str, Any] | None:
        raw = self.load_raw(key)
        return None if raw is None else dict(json.loads(raw))

    async def delete_session(self, key: str) -> None:
        self._s.sessions.pop(key, None)

    async def save_reply(self, reply: str, entry: str) -> None:
        now, replies = self._clock(), self._s.replies
        # One TTL for all: the oldest expire first, so the expired are pruned from the front.
        while replies and next(iter(replies.values()))[0] <= now:
            del replies[next(iter(replies))]
        replies.pop(reply, None)
        replies[reply] = (now + round(self._cfg.session_ttl_s * 1000), entry)

    async def load_reply(self, reply: str) -> str | None:
        hit = self._s.replies.get(reply)
        if hit is None or hit[0] <= self._clock():
            self._s.replies.pop(reply, None)
            return None
        return hit[1]
