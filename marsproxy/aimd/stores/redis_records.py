"""The Redis store's global-queue entries and session records: written through to Redis and
mirrored in the replica's :class:`MemoryStore`, which serves them while Redis is away; what
changed meanwhile is marked (``q_gone``, ``dirty``, ``deleted``, ``gen``) for the resync.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from redis.asyncio import Redis

from marsproxy.aimd.stores.memory import MemoryStore
from marsproxy.aimd.stores.redis_keys import Keys, Scripts
from marsproxy.aimd.stores.redis_link import FAILURES, RedisLink


class RedisRecords:
    """Mixin of :class:`~.redis_store.RedisStore`; the attributes below are set there."""

    local: MemoryStore
    link: RedisLink
    keys: Keys
    scripts: Scripts
    _id: str
    redis: Redis
    gen: int
    q_gone: set[str]
    dirty: set[str]
    deleted: set[str]
    session_ms: int
    lease_ms: int

    async def enqueue(self, session: str, score: float) -> None:
        self.local.enqueue_sync(session, score)
        self.q_gone.discard(session)
        if self.link.up:
            try:  # marked as asked, as admit_ranked.lua does: a live replica's entry
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.zadd(self.keys.queue, {session: score})
                    pipe.set(self.keys.asked(session), 1, px=self.lease_ms)
                    await self.link.io(pipe.execute())
                return
            except FAILURES as exc:
                self.link.fail(exc)
        self.gen += 1

    async def dequeue(self, session: str) -> None:
        self.local.dequeue_sync(session)
        if self.link.up:
            try:
                await self.link.io(self.redis.zrem(self.keys.queue, session))
                return
            except FAILURES as exc:
                self.link.fail(exc)
        self.q_gone.add(session)
        self.gen += 1

    async def queue_rank(self, session: str) -> int | None:
        if self.link.up:
            try:
                rank: Any = await self.link.io(self.redis.zrank(self.keys.queue, session))
                return None if rank is None else int(rank)  # typed int | list (WITHSCORE)
            except FAILURES as exc:
                self.link.fail(exc)
        return self.local.rank_sync(session)

    async def queue_len(self) -> int:
        if self.link.up:
            try:
                return int(await self.link.io(self.redis.zcard(self.keys.queue)))
            except FAILURES as exc:
                self.link.fail(exc)
        return len(self.local.queue_items())

    async def exchange_counters(self, charges: Mapping[str, float]) -> dict[str, float] | None:
        # One round trip: the increments, then the sums (other replicas' included).
        if not self.link.up:
            return None
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for tenant, c in charges.items():
                    pipe.hincrbyfloat(self.keys.tenants, tenant, c)
                pipe.hgetall(self.keys.tenants)
                got = await self.link.io(pipe.execute())
        except FAILURES as exc:
            self.link.fail(exc)
            return None
        return {str(t): float(v) for t, v in got[-1].items()}

    async def save_session(self, key: str, record: Mapping[str, Any]) -> None:
        raw = json.dumps(record, separators=(",", ":"))
        self.local.save_raw(key, raw)  # the copy that serves this session while Redis is away
        self.deleted.discard(key)
        if self.link.up:
            # Fenced: not over another replica's record of it, nor after its end (save.lua).
            keys = self.keys.saved(key, str(record.get("worker")))
            try:
                await self.link.io(self.scripts.save(keys=keys,
                                                     args=[raw, self.session_ms, self._id, key]))
                return
            except FAILURES as exc:
                self.link.fail(exc)
        self.dirty.add(key)
        self.gen += 1

    async def load_session(self, key: str) -> dict[str, Any] | None:
        if self.link.up:
            try:
                raw = await self.link.io(self.redis.get(self.keys.session(key)))
            except FAILURES as exc:
                self.link.fail(exc)
            else:
                if raw is None:
                    await self.local.delete_session(key)
                    return None
                self.local.save_raw(key, str(raw))
                return dict(json.loads(raw))
        raw_local = self.local.load_raw(key)
        return None if raw_local is None else dict(json.loads(raw_local))

    async def delete_session(self, key: str) -> None:
        await self.local.delete_session(key)
        self.dirty.discard(key)
        if self.link.up:
            try:
                await self.link.io(self.redis.delete(self.keys.session(key)))
                return
            except FAILURES as exc:
                self.link.fail(exc)
        self.deleted.add(key)
        self.gen += 1

    async def save_reply(self, reply: str, entry: str) -> None:
        # Not mirrored: this replica knows its own replies; while Redis is away, others don't.
        if self.link.up:
            try:
                await self.link.io(self.redis.set(self.keys.reply(reply), entry,
                                                  px=self.session_ms))
            except FAILURES as exc:
                self.link.fail(exc)

    async def load_reply(self, reply: str) -> str | None:
        if not self.link.up:
            return None
        try:
            raw = await self.link.io(self.redis.get(self.keys.reply(reply)))
        except FAILURES as exc:
            self.link.fail(exc)
            return None
        return None if raw is None else str(raw)
