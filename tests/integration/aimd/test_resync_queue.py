"""After an outage no queue entry is left in Redis for a session that left the queue.

Found by the soak (scripts/soak.py): Redis ops timed out under load, the replica resynced,
and sessions admitted while the resync pipeline was on its way stayed in the global queue for
good, ranking ahead of every later session: those admitted locally (``on_store_failure:
local``) while Redis was away, and those that left while a resync pipeline was on its way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis

from marsproxy.aimd.stores import RedisStore, StoreConfig
from marsproxy.aimd.stores.resync import resync

T = TypeVar("T")


async def test_resync_does_not_re_add_a_session_that_left_the_queue(private_redis: Any) -> None:
    cfg = StoreConfig(backend="redis", redis_url=private_redis.url, pool="resync-queue",
                      op_timeout_s=0.5, reconnect_interval_s=0.1)
    store = RedisStore(cfg)
    await store.start()
    r = aioredis.Redis.from_url(private_redis.url, decode_responses=True)
    try:
        await store.enqueue("gone", 1.0)
        await store.enqueue("waiting", 2.0)
        real_io = store.io
        raced = False

        async def racing_io(aw: Awaitable[T]) -> T:
            nonlocal raced
            if not raced:  # the resync's pipeline is next: the session leaves first
                raced = True
                await store.dequeue("gone")
            return await real_io(aw)

        store.io = racing_io  # type: ignore[method-assign]
        await resync(store)
        store.io = real_io  # type: ignore[method-assign]
        assert raced
        assert await r.zrange(store.keys.queue, 0, -1) == ["waiting"]
    finally:
        await r.aclose()
        await store.close()


@pytest.mark.parametrize("mode", ["local", "open"])
async def test_a_session_admitted_during_an_outage_leaves_the_redis_queue(
    private_redis: Any, mode: str
) -> None:
    cfg = StoreConfig(backend="redis", redis_url=private_redis.url, pool="outage-queue",
                      on_store_failure=mode, op_timeout_s=0.2, reconnect_interval_s=0.1)
    store = RedisStore(cfg)
    await store.start()
    r = aioredis.Redis.from_url(private_redis.url, decode_responses=True)
    try:
        await store.enqueue("s", 1.0)  # in Redis's queue too
        private_redis.pause()  # ops time out: the store falls back to its mode
        try:
            assert await store.admit_if_ranked("s", 1, "w0", 4, 1_000) is True
            assert store.up is False
        finally:
            private_redis.resume()
        deadline = asyncio.get_running_loop().time() + 5
        while not store.up:  # the reconnect loop resyncs, then says it is up
            assert asyncio.get_running_loop().time() < deadline, "no recovery within 5 s"
            await asyncio.sleep(0.05)
        assert await r.zrange(store.keys.queue, 0, -1) == []
        assert await r.zrange(store.keys.adm("w0"), 0, -1) == ["s"]
    finally:
        await r.aclose()
        await store.close()


async def test_queue_entries_a_failover_left_behind_are_removed(private_redis: Any) -> None:
    """A failover can lose the queue removal of a session admitted just before it: the new
    primary then has the session both admitted and waiting, and that entry would rank ahead
    of every newcomer for good. The resync drops entries of sessions with a live lease, and
    ending a session drops its entry."""
    cfg = StoreConfig(backend="redis", redis_url=private_redis.url, pool="stale-queue",
                      op_timeout_s=0.5, reconnect_interval_s=0.1)
    store = RedisStore(cfg)
    await store.start()
    r = aioredis.Redis.from_url(private_redis.url, decode_responses=True)
    try:
        now = store.clock()
        for s, score in (("held", 1.0), ("ends", 2.0)):
            assert await store.admit_if_ranked(s, 5, "w0", 5, now, score=score)
        await store.enqueue("waiting", 3.0)
        # What the new primary holds after the failover: the two removals were lost.
        await r.zadd(store.keys.queue, {"held": 1.0, "ends": 2.0})
        assert await store.queue_rank("waiting") == 2
        await resync(store)
        assert await r.zrange(store.keys.queue, 0, -1) == ["waiting"]

        await r.zadd(store.keys.queue, {"ends": 2.0})
        assert await store.release("w0", "ends")
        assert await r.zrange(store.keys.queue, 0, -1) == ["waiting"]
        assert await store.queue_rank("waiting") == 0
    finally:
        await r.aclose()
        await store.close()
