"""Several Redis-store replicas on the shared Redis, in real time, with their background
heartbeats running: the total never exceeds the window, a killed replica's slots come back
within one lease TTL, and a dead leader is replaced within the leader TTL.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from marsproxy.aimd.stores import RedisStore, StoreConfig, wall_clock_ms

MakeReplica = Callable[..., Awaitable[RedisStore]]


@pytest.fixture
async def make_replica(pool: str) -> AsyncIterator[MakeReplica]:
    started: list[RedisStore] = []

    async def _make(**overrides: Any) -> RedisStore:
        cfg = StoreConfig(backend="redis", pool=pool, **overrides)
        store = RedisStore(cfg)
        await store.start()
        started.append(store)
        return store

    yield _make
    for s in started:
        await s.close()


async def test_replicas_under_concurrent_load_never_exceed_the_limit(
    make_replica: MakeReplica, pool: str
) -> None:
    reps = [await make_replica(heartbeat_interval_s=0.1, lease_ttl_s=5) for _ in range(3)]
    workers, limit = ["w1", "w2"], 5
    held = dict.fromkeys(workers, 0)  # admitted right now, as the clients see it
    peak = dict.fromkeys(workers, 0)
    zcard_peak = dict.fromkeys(workers, 0)
    admits = 0
    stop = time.monotonic() + 1.5
    keys = reps[0].keys
    r = aioredis.Redis(decode_responses=True)

    async def client(n: int) -> None:
        nonlocal admits
        rep, rng = reps[n % 3], random.Random(n)
        i = 0
        while time.monotonic() < stop:
            w, session = rng.choice(workers), f"c{n}-{i}"
            i += 1
            if await rep.try_admit(w, session, limit, wall_clock_ms()):
                admits += 1
                held[w] += 1
                peak[w] = max(peak[w], held[w])
                await asyncio.sleep(rng.random() * 0.005)
                held[w] -= 1
                await rep.release(w, session)
            else:
                await asyncio.sleep(0.001)

    async def observer() -> None:
        while time.monotonic() < stop:
            for w in workers:
                zcard_peak[w] = max(zcard_peak[w], await r.zcard(keys.adm(w)))
            await asyncio.sleep(0.002)

    await asyncio.gather(observer(), *(client(n) for n in range(60)))
    try:
        assert admits > 200  # the load was real
        assert all(peak[w] <= limit for w in workers), peak
        assert all(zcard_peak[w] <= limit for w in workers), zcard_peak
        assert zcard_peak == dict.fromkeys(workers, limit)  # and the window was used fully
        for w in workers:
            assert await r.zcard(keys.adm(w)) == 0 and await r.hlen(keys.own(w)) == 0
        assert all(s.failures_total == 0 for s in reps)
    finally:
        await r.aclose()


async def test_a_killed_replicas_slots_return_within_one_lease_ttl(
    make_replica: MakeReplica,
) -> None:
    ttl = dict(lease_ttl_s=1.0, heartbeat_interval_s=0.2)
    a, b = await make_replica(**ttl), await make_replica(**ttl)
    assert await b.try_admit("w1", "b0", 3, wall_clock_ms())
    now = wall_clock_ms()  # one admission time: both leases end together
    assert all([await a.try_admit("w1", f"a{i}", 3, now) for i in range(2)])
    assert not await b.try_admit("w1", "b1", 3, wall_clock_ms())
    await a.close()  # SIGKILL-like: no release, no more heartbeats
    killed = time.monotonic()
    while not await b.try_admit("w1", "b1", 3, wall_clock_ms()):
        assert time.monotonic() - killed < 1.3, "slots did not come back within one lease TTL"
        await asyncio.sleep(0.02)
    assert await b.try_admit("w1", "b2", 3, wall_clock_ms())  # both of a's slots came back
    await asyncio.sleep(1.2)  # b's own leases outlive the TTL: its heartbeat renews them
    assert await b.admitted_sessions("w1") == ["b0", "b1", "b2"]


async def test_a_dead_replicas_waiting_entries_leave_at_a_live_replicas_heartbeat(
    make_replica: MakeReplica,
) -> None:
    """A replica died with sessions waiting in the global queue, and the last session behind
    them was admitted while their marks still lived: nobody asks behind them any more, but a
    live replica's next heartbeat drops them (its own waiting sessions, marked, stay)."""
    ttl = dict(lease_ttl_s=0.4, heartbeat_interval_s=0.1)
    a, b = await make_replica(**ttl), await make_replica(**ttl)
    for i in range(3):
        await b.enqueue(f"b{i}", float(i))
    await b.close()  # SIGKILL-like: its entries stay, their marks run out
    await a.enqueue("a0", 10.0)
    killed = time.monotonic()
    while await a.queue_len() > 1:  # a's own entry is asked for, as a live replica's is
        assert time.monotonic() - killed < 3.0, "b's entries are still in the queue"
        await a.enqueue("a0", 10.0)
        await asyncio.sleep(0.05)
    assert await a.queue_rank("a0") == 0


async def test_the_leader_dies_and_another_takes_over_within_leader_ttl(
    make_replica: MakeReplica,
) -> None:
    cfg = dict(leader_ttl_s=0.5)
    reps = [await make_replica(**cfg) for _ in range(3)]
    alive = set(range(3))

    async def elect() -> None:  # each replica's control loop tries every 100 ms
        while True:
            for i in list(alive):
                await reps[i].try_lead(wall_clock_ms())
            await asyncio.sleep(0.1)

    loop = asyncio.create_task(elect())
    try:
        await asyncio.sleep(0.3)
        leaders = [i for i in alive if reps[i].is_leader]
        assert len(leaders) == 1
        dead = leaders[0]
        alive.discard(dead)
        await reps[dead].close()
        died = time.monotonic()
        while not any(reps[i].is_leader for i in alive):
            assert time.monotonic() - died < 0.5 + 0.15, "no new leader within leader_ttl"
            await asyncio.sleep(0.01)
        assert sum(reps[i].is_leader for i in alive) == 1
    finally:
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop


async def test_a_session_record_and_its_lease_survive_the_replica_that_wrote_them(
    make_replica: MakeReplica,
) -> None:
    a, b = await make_replica(), await make_replica()
    assert await a.try_admit("w1", "t:s", 4, wall_clock_ms())
    await a.save_session("t:s", {"worker": "w1", "prompt_tokens": 900, "attained_s": 1.5})
    await a.close()
    rec = await b.load_session("t:s")
    assert rec is not None and rec["worker"] == "w1"
    # b serves the next call: the admit is idempotent and b now renews the lease.
    assert await b.try_admit(rec["worker"], "t:s", 4, wall_clock_ms())
    assert await b.renew(wall_clock_ms()) == 1
    assert await b.admitted_sessions("w1") == ["t:s"]


async def test_a_record_written_after_its_session_ended_stays_deleted(
    make_replica: MakeReplica,
) -> None:
    a, b = await make_replica(), await make_replica()
    assert await a.try_admit("w1", "t:s", 4, wall_clock_ms())
    await a.save_session("t:s", {"worker": "w1", "turns": 1})
    assert await b.release("w1", "t:s", any_owner=True)  # DELETE on b
    # a's write of its last response lands after the end: it must not bring the record back
    # (another replica would read it and try to adopt an ended session).
    await a.save_session("t:s", {"worker": "w1", "turns": 2})
    assert await b.load_session("t:s") is None
    # The same id as a new session (its admission clears the tombstone) is recorded again.
    assert await b.try_admit("w1", "t:s", 4, wall_clock_ms())
    await b.save_session("t:s", {"worker": "w1", "turns": 1})
    assert await a.load_session("t:s") == {"worker": "w1", "turns": 1}


async def test_a_burst_uses_at_most_max_connections(pool: str) -> None:
    """400 concurrent record loads and admissions share the bounded pool: Redis sees at most
    ``store.max_connections`` (+1 wake-up subscription) clients of this replica, all named, and
    the store stays up (with a socket per concurrent op, such a burst was a connect storm whose
    slow connects exceeded op_timeout_s and read as a Redis outage). Each op's wait for a pooled
    connection counts in its op_timeout_s: 2 s, not the default 0.5, so that a pause of this
    shared machine in the queue of 100 ops per connection is no outage (the count of clients
    is what tells a pool from a connect storm)."""
    store = RedisStore(StoreConfig(backend="redis", pool=pool, max_connections=4,
                                   op_timeout_s=2.0))
    await store.start()
    r = aioredis.Redis(decode_responses=True)
    try:
        name = f"marsproxy:{pool}"
        results = await asyncio.gather(
            *(store.load_session(f"s{i}") for i in range(200)),
            *(store.try_admit("w1", f"a{i}", 1000, wall_clock_ms()) for i in range(200)),
        )
        assert results[:200] == [None] * 200 and all(results[200:])
        assert store.up
        clients = [c for c in await r.client_list() if c["name"].startswith(name)]
        ops = [c for c in clients if c["name"] == name]
        assert 1 <= len(ops) <= 4, clients
        assert [c["name"] for c in clients if c not in ops] == [f"{name}:wakeups"]
    finally:
        await store.close()
        await r.aclose()
