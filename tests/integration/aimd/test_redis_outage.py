"""Redis goes away mid-run and comes back (a private redis-server, never the shared one).

Under each ``on_store_failure`` mode the replicas behave as documented while it is away, and
after it is back the lease ZSET holds every session they admitted and did not release, each
exactly once — also when the restarted Redis lost all its data.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from marsproxy.aimd.stores import RedisStore, StoreConfig, WindowRecord, wall_clock_ms

LIMIT = 6
MakeReplica = Callable[..., Awaitable[RedisStore]]


@pytest.fixture
async def make_replica(private_redis: Any) -> AsyncIterator[MakeReplica]:
    started: list[RedisStore] = []

    async def _make(mode: str) -> RedisStore:
        cfg = StoreConfig(
            backend="redis",
            redis_url=private_redis.url,
            pool="outage",
            on_store_failure=mode,
            op_timeout_s=0.2,
            reconnect_interval_s=0.1,
            lease_ttl_s=3,
            heartbeat_interval_s=0.5,
        )
        store = RedisStore(cfg)
        await store.start()
        started.append(store)
        return store

    yield _make
    for s in started:
        await s.close()


async def _admit(store: RedisStore, sessions: list[str], held: set[str]) -> list[bool]:
    got = [await store.try_admit("w1", s, LIMIT, wall_clock_ms()) for s in sessions]
    held.update(s for s, ok in zip(sessions, got, strict=True) if ok)
    return got


async def _members(url: str, store: RedisStore) -> tuple[list[str], dict[str, str]]:
    r = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        members = await r.zrange(store.keys.adm("w1"), 0, -1)
        owners = await r.hgetall(store.keys.own("w1"))
        return [str(m) for m in members], {str(k): str(v) for k, v in owners.items()}
    finally:
        await r.aclose()


@pytest.mark.parametrize(
    ("mode", "during_a", "during_b"),
    [
        # local: the window (6) divided among the 2 live replicas: 3 each, counting what each
        # already holds (a: 2, b: 1).
        ("local", [True, False, False], [True, True, False]),
        ("closed", [False, False, False], [False, False, False]),
        ("open", [True, True, True], [True, True, True]),
    ],
)
async def test_redis_killed_and_restarted(
    make_replica: MakeReplica,
    private_redis: Any,
    eventually: Any,
    mode: str,
    during_a: list[bool],
    during_b: list[bool],
) -> None:
    a, b = await make_replica(mode), await make_replica(mode)

    async def a_counts_b() -> bool:
        # b's heartbeat may have to come round again if a stall outlived its entry.
        await a.renew(wall_clock_ms())
        return a.live_replicas == 2

    await eventually(a_counts_b, 5.0)
    held: set[str] = set()
    assert await _admit(a, ["a0", "a1"], held) == [True, True]
    assert await _admit(b, ["b0"], held) == [True]
    assert await a.try_lead(wall_clock_ms())
    window = {"w1": WindowRecord(limit=LIMIT, window=LIMIT, updated_ms=wall_clock_ms())}
    assert await a.publish_windows(window) and await b.read_windows() == window
    await a.save_session("t:a0", {"worker": "w1", "prompt_tokens": 10})

    private_redis.kill()
    assert await _admit(a, ["a2", "a3", "a4"], held) == during_a
    assert await _admit(b, ["b1", "b2", "b3"], held) == during_b
    assert not a.up and not b.up and a.mode == mode and a.failures_total >= 1
    assert await a.try_admit("w1", "a0", LIMIT, wall_clock_ms())  # admitted stays admitted
    await a.release("w1", "a1")
    held.discard("a1")
    assert await b.read_windows() == window  # the last windows serve while Redis is away
    assert not await a.try_lead(wall_clock_ms()) and not a.is_leader
    await a.save_session("t:a0", {"worker": "w1", "prompt_tokens": 99})
    assert await a.load_session("t:a0") == {"worker": "w1", "prompt_tokens": 99}

    private_redis.start()  # empty: no persistence
    await eventually(lambda: a.up and b.up, 5.0)
    members, owners = await _members(private_redis.url, a)
    assert sorted(members) == sorted(held)  # nothing lost, "a1" not resurrected
    assert len(members) == len(set(members))
    mine = {s for s, o in owners.items() if o == a.replica_id}
    assert mine == {s for s in held if s.startswith("a")}
    assert await b.load_session("t:a0") == {"worker": "w1", "prompt_tokens": 99}
    # Shared admission is back: the ZSET is the count again (once the hold after a recovery,
    # test_redis_recover_hold.py, is over).
    assert await b.admitted("w1") == len(held)
    await asyncio.sleep(b.cfg.hold_s)
    assert await b.try_admit("w1", "b9", LIMIT, wall_clock_ms()) == (len(held) < LIMIT)


async def test_redis_paused_keeps_its_data_and_resync_drops_what_was_released(
    make_replica: MakeReplica, private_redis: Any, eventually: Any
) -> None:
    a = await make_replica("local")
    held: set[str] = set()
    assert await _admit(a, ["a0", "a1"], held) == [True, True]
    await a.enqueue("q0", 1.0)
    private_redis.pause()  # hangs: ops time out instead of failing fast
    await a.release("w1", "a1")  # times out: Redis still holds a1
    held.discard("a1")
    assert not a.up
    assert await _admit(a, ["a2"], held) == [True]
    await a.dequeue("q0")
    await a.enqueue("q1", 2.0)
    private_redis.resume()
    await eventually(lambda: a.up, 5.0)
    members, _ = await _members(private_redis.url, a)
    assert sorted(members) == ["a0", "a2"]
    assert await a.queue_rank("q0") is None and await a.queue_rank("q1") == 0


async def test_flushed_scripts_are_reloaded_without_an_outage(
    make_replica: MakeReplica, private_redis: Any
) -> None:
    a = await make_replica("closed")
    assert await a.try_admit("w1", "s0", 100, wall_clock_ms())
    r = aioredis.Redis.from_url(private_redis.url)
    try:
        await r.script_flush()  # what a restarted Redis with kept data looks like to a client
    finally:
        await r.aclose()
    # Concurrent calls: the first goes alone, the others ride a batch; both paths hit NOSCRIPT.
    got = await asyncio.gather(
        *(a.try_admit("w1", f"s{i}", 100, wall_clock_ms()) for i in range(1, 40))
    )
    assert all(got) and a.up and a.failures_total == 0
    assert await a.admitted("w1") == 40


async def test_a_replica_started_while_redis_is_down_serves_locally_then_joins(
    make_replica: MakeReplica, private_redis: Any, eventually: Any
) -> None:
    private_redis.kill()
    a = await make_replica("local")
    assert not a.up and a.mode == "local" and a.failures_total == 1
    held: set[str] = set()
    assert await _admit(a, ["a0", "a1", "a2"], held) == [True, True, True]
    private_redis.start()
    await eventually(lambda: a.up, 5.0)
    members, _ = await _members(private_redis.url, a)
    assert sorted(members) == ["a0", "a1", "a2"]


async def test_a_session_ended_elsewhere_during_an_outage_is_not_written_back(
    make_replica: MakeReplica, private_redis: Any, eventually: Any
) -> None:
    a, b = await make_replica("local"), await make_replica("local")
    held: set[str] = set()
    assert await _admit(a, ["t/id/x", "t/id/y"], held) == [True, True]
    a.fail(ConnectionError("cut off"))  # a alone loses Redis (a partition, not a dead Redis)
    assert not a.up and b.up
    assert await b.release("w1", "t/id/x", any_owner=True)  # a DELETE on b ends x
    await eventually(lambda: a.up, 5.0)  # a resyncs its local leases ...
    members, _ = await _members(private_redis.url, a)
    assert members == ["t/id/y"]  # ... but not the one ended meanwhile
    assert a.drain_lost() == [("w1", "t/id/x")]
    # The id may start a new session later: the tombstone does not stand in its way.
    assert await b.try_admit("w1", "t/id/x", LIMIT, wall_clock_ms())


async def test_redis_restarted_empty_between_two_ops_is_an_outage_not_every_lease_lost(
    make_replica: MakeReplica, private_redis: Any, eventually: Any
) -> None:
    """A restart fast enough that no op of the replica failed (a supervisor restarting a
    crashed Redis: the pool reconnects silently). Its next heartbeat finds every lease gone;
    those are not releases: the leases are written back, as after any outage, and no admitted
    session is reported lost (the gateway would forget them all)."""
    a = await make_replica("local")
    held: set[str] = set()
    assert await _admit(a, ["a0", "a1"], held) == [True, True]
    private_redis.kill()
    private_redis.start()  # empty: no persistence
    await a.renew(wall_clock_ms())  # the heartbeat is the first op to reach the new Redis
    await eventually(lambda: a.up, 5.0)
    assert a.drain_lost() == []
    members, owners = await _members(private_redis.url, a)
    assert sorted(members) == ["a0", "a1"]
    assert set(owners.values()) == {a.replica_id}


def _record(store: RedisStore, turns: int) -> dict[str, Any]:
    return {"worker": "w1", "turns": turns, "replica": store.replica_id}


async def test_a_record_written_back_after_an_outage_keeps_off_a_moved_session(
    make_replica: MakeReplica, private_redis: Any, eventually: Any
) -> None:
    """x moved from a to b; a, cut off before its heartbeat told it so, still saved x's record
    (one of its turns ending): the write-back leaves the new holder's record standing."""
    a, b = await make_replica("local"), await make_replica("local")
    assert await a.try_admit("w1", "t/id/x", LIMIT, wall_clock_ms())
    await a.save_session("t/id/x", _record(a, 1))
    assert await b.claim("w1", "t/id/x", wall_clock_ms())  # x's next request went to b
    await b.save_session("t/id/x", _record(b, 2))
    a.fail(ConnectionError("cut off"))  # a alone loses Redis (a partition, not a dead Redis)
    await a.save_session("t/id/x", _record(a, 1))  # kept locally, to be written back
    assert not a.up and a.dirty == {"t/id/x"}
    await eventually(lambda: a.up and not a.dirty, 5.0)
    assert await b.load_session("t/id/x") == _record(b, 2)


async def test_a_record_written_back_after_an_outage_does_not_revive_an_ended_session(
    make_replica: MakeReplica, private_redis: Any, eventually: Any
) -> None:
    a, b = await make_replica("local"), await make_replica("local")
    assert await a.try_admit("w1", "t/id/x", LIMIT, wall_clock_ms())
    await a.save_session("t/id/x", _record(a, 1))
    assert await b.release("w1", "t/id/x", any_owner=True)  # a DELETE on b ends x
    a.fail(ConnectionError("cut off"))
    await a.save_session("t/id/x", _record(a, 2))
    assert not a.up and a.dirty == {"t/id/x"}
    await eventually(lambda: a.up and not a.dirty, 5.0)
    assert await b.load_session("t/id/x") is None
    assert a.drain_lost() == [("w1", "t/id/x")]


async def test_a_record_deleted_during_an_outage_stays_with_the_session_that_moved(
    make_replica: MakeReplica, private_redis: Any, eventually: Any
) -> None:
    """x moved from a to b; a, cut off, ends x (its idle timeout: a believes it still holds
    it): the deletion written back on resync leaves b's record of x standing."""
    a, b = await make_replica("local"), await make_replica("local")
    assert await a.try_admit("w1", "t/id/x", LIMIT, wall_clock_ms())
    assert await b.claim("w1", "t/id/x", wall_clock_ms())
    await b.save_session("t/id/x", _record(b, 2))
    a.fail(ConnectionError("cut off"))
    await a.release("w1", "t/id/x")  # kept locally, written back on resync
    assert not a.up and a.deleted == {"t/id/x"}
    await eventually(lambda: a.up and not a.deleted, 5.0)
    assert await b.load_session("t/id/x") == _record(b, 2)
