"""The ``WindowStore`` contract, run against both backends: the in-memory store (several
instances sharing one ``MemoryState`` play the replicas) and the Redis store on the shared
Redis. Lease times follow an injected clock; only Redis' own TTLs (leader key) need real time.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from marsproxy.aimd.stores import (
    HeldElsewhere,
    MemoryState,
    MemoryStore,
    RedisStore,
    StoreConfig,
    WindowRecord,
    WindowStore,
)

LEASE_MS = 60_000


class Replicas:
    """Builds replicas of one pool on the chosen backend, and lets time pass for all."""

    def __init__(self, backend: str, clock: Any, pool: str) -> None:
        self.backend = backend
        self.clock = clock
        self.cfg = StoreConfig(
            backend="redis" if backend == "redis" else "memory",
            pool=pool,
            lease_ttl_s=LEASE_MS / 1000,
            heartbeat_interval_s=20,  # no background heartbeat inside a test: renew() by hand
            leader_ttl_s=0.3,
        )
        self.state = MemoryState()
        self.stores: list[WindowStore] = []

    async def new(self) -> WindowStore:
        store: WindowStore
        if self.backend == "redis":
            store = RedisStore(self.cfg, clock=self.clock)
        else:
            store = MemoryStore(self.cfg, clock=self.clock, state=self.state)
        await store.start()
        self.stores.append(store)
        return store

    async def pass_ms(self, ms: int) -> None:
        self.clock.advance(ms)
        if self.backend == "redis":  # the leader key's PX runs on Redis' clock
            await asyncio.sleep(ms / 1000)

    async def close(self) -> None:
        for s in self.stores:
            await s.close()


@pytest.fixture(params=["memory", "redis"])
async def replicas(request: pytest.FixtureRequest, clock: Any) -> AsyncIterator[Replicas]:
    if request.param == "redis":
        pool = str(request.getfixturevalue("pool"))
    else:
        pool = f"mem-{uuid.uuid4().hex[:8]}"
    reps = Replicas(request.param, clock, pool)
    yield reps
    await reps.close()


async def test_admits_up_to_the_limit_idempotently(replicas: Replicas) -> None:
    a = await replicas.new()
    now = replicas.clock()
    assert [await a.try_admit("w1", f"s{i}", 3, now) for i in range(4)] == [True] * 3 + [False]
    assert await a.try_admit("w1", "s0", 3, now)  # already admitted: renewed, still True
    assert await a.admitted("w1") == 3
    assert await a.admitted_sessions("w1") == ["s0", "s1", "s2"]
    assert await a.try_admit("w2", "x", 1, now)  # windows are per worker
    await a.release("w1", "s1")
    assert await a.try_admit("w1", "s3", 3, now)
    assert await a.admitted_sessions("w1") == ["s0", "s2", "s3"]


async def test_limit_is_shared_by_replicas(replicas: Replicas) -> None:
    a, b = await replicas.new(), await replicas.new()
    now = replicas.clock()
    assert await a.try_admit("w1", "a1", 2, now)
    assert await b.try_admit("w1", "b1", 2, now)
    assert not await b.try_admit("w1", "b2", 2, now)
    assert not await a.try_admit("w1", "a2", 2, now)
    await a.release("w1", "a1")
    assert await b.try_admit("w1", "b2", 2, now)


async def test_unrenewed_leases_expire_and_are_reaped_on_admit(replicas: Replicas) -> None:
    a, b = await replicas.new(), await replicas.new()
    now = replicas.clock()
    assert await a.try_admit("w1", "a1", 2, now)
    assert await b.try_admit("w1", "b1", 2, now)
    replicas.clock.advance(LEASE_MS // 2)
    assert await b.renew(replicas.clock()) == 1  # b heartbeats, a has died
    replicas.clock.advance(LEASE_MS // 2 + 1)
    assert await a.admitted("w1") == 1  # a1's lease ran out
    assert await b.try_admit("w1", "b2", 2, replicas.clock())
    assert await b.admitted_sessions("w1") == ["b1", "b2"]


async def test_heartbeat_keeps_leases_alive_indefinitely(replicas: Replicas) -> None:
    a = await replicas.new()
    assert await a.try_admit("w1", "s", 1, replicas.clock())
    for _ in range(5):
        replicas.clock.advance(LEASE_MS - 1)
        assert await a.renew(replicas.clock()) == 1
    assert await a.admitted_sessions("w1") == ["s"]


async def test_a_moved_session_is_renewed_by_its_new_replica_only(replicas: Replicas) -> None:
    a, b = await replicas.new(), await replicas.new()
    assert await a.try_admit("w1", "s", 1, replicas.clock())
    assert await b.try_admit("w1", "s", 1, replicas.clock())  # the next call landed on b
    assert await a.renew(replicas.clock()) == 0
    await b.release("w1", "s")
    assert await a.renew(replicas.clock()) == 0  # a does not resurrect it
    assert await a.admitted("w1") == 0


async def test_one_leader_and_failover_after_its_ttl(replicas: Replicas) -> None:
    a, b = await replicas.new(), await replicas.new()
    now = replicas.clock()
    assert await a.try_lead(now) and a.is_leader
    assert not await b.try_lead(now) and not b.is_leader
    rec = {"w1": WindowRecord(limit=7, window=9, updated_ms=now, reason="increase",
                              idle_limit=9)}
    assert await a.publish_windows(rec)
    assert not await b.publish_windows({"w1": WindowRecord(1, 1, now)})  # fenced
    assert await b.read_windows() == rec
    assert await a.try_lead(now)  # the holder renews
    await replicas.pass_ms(350)  # a stops renewing: dead
    assert not a.is_leader
    assert await b.try_lead(replicas.clock()) and b.is_leader
    assert not await a.try_lead(replicas.clock())
    assert await b.publish_windows({"w2": WindowRecord(3, 3, now)})
    assert set(await a.read_windows()) == {"w2"}


async def test_global_queue_order_gates_admission(replicas: Replicas) -> None:
    a, b = await replicas.new(), await replicas.new()
    now = replicas.clock()
    await a.enqueue("first", 1.0)
    await b.enqueue("second", 2.0)
    await b.enqueue("third", 3.0)
    assert await a.queue_len() == 3 and await b.queue_rank("third") == 2
    assert not await b.admit_if_ranked("second", 1, "w1", 10, now)  # rank 1, one free slot
    assert await b.queue_rank("second") == 1  # still waiting
    assert await a.admit_if_ranked("first", 1, "w1", 10, now)
    assert await a.queue_rank("first") is None and await a.queue_len() == 2
    assert await a.admit_if_ranked("first", 1, "w1", 10, now)  # idempotent once admitted
    assert await b.admit_if_ranked("second", 1, "w1", 10, now)
    assert not await b.admit_if_ranked("third", 1, "w1", 2, now)  # ranked, but w1 is full
    assert await b.queue_rank("third") == 0
    await b.dequeue("third")
    assert await b.queue_len() == 0
    assert not await b.admit_if_ranked("never-queued", 5, "w1", 10, now)


async def test_requeue_changes_the_order(replicas: Replicas) -> None:
    a = await replicas.new()
    await a.enqueue("x", 5.0)
    await a.enqueue("y", 6.0)
    await a.enqueue("y", 1.0)  # re-scored (e.g. the order mode changed)
    assert await a.queue_rank("y") == 0 and await a.queue_len() == 2


async def test_ranked_admission_is_atomic_under_concurrency(replicas: Replicas) -> None:
    reps = [await replicas.new() for _ in range(3)]
    for i in range(30):
        await reps[i % 3].enqueue(f"s{i:02d}", float(i))
    now = replicas.clock()

    async def attempt(i: int) -> bool:
        return await reps[i % 3].admit_if_ranked(f"s{i:02d}", 5, "w1", 5, now)

    got = await asyncio.gather(*(attempt(i) for i in range(30)))
    admitted = {f"s{i:02d}" for i, ok in enumerate(got) if ok}
    # Five slots: five admitted, each left the queue in the same step, nobody lost or doubled.
    assert len(admitted) == 5 and await reps[0].admitted("w1") == 5
    assert await reps[1].queue_len() == 25
    assert all([await reps[2].queue_rank(s) is None for s in admitted])
    # A session beyond the free slots never passes, whoever asks.
    assert not any([await r.admit_if_ranked("s29", 5, "w2", 100, now) for r in reps])


async def test_session_records_outlive_the_replica_that_wrote_them(replicas: Replicas) -> None:
    a, b = await replicas.new(), await replicas.new()
    rec = {"worker": "w1", "context_tokens": 1234, "attained_s": 2.5, "tools": {"pytest": 3.1}}
    await a.save_session("t:abc", rec)
    rec["worker"] = "changed after saving"
    await a.close()
    assert await b.load_session("t:abc") == {**rec, "worker": "w1"}
    await b.delete_session("t:abc")
    assert await b.load_session("t:abc") is None
    assert await b.load_session("t:never") is None


async def test_a_reply_names_its_session_to_every_replica_for_the_session_ttl(
    replicas: Replicas,
) -> None:
    a, b = await replicas.new(), await replicas.new()
    await a.save_reply("t:r1", "t/chain/1@a")
    await b.save_reply("t:r2", "t/chain/1@a")  # the session's next reply, relayed by b
    assert [await b.load_reply("t:r1"), await a.load_reply("t:r2")] == ["t/chain/1@a"] * 2
    assert await a.load_reply("t:never") is None
    if replicas.backend == "redis":  # Redis' own clock expires it: its TTL is set
        redis = cast(RedisStore, a)
        ttl = await redis.redis.pttl(redis.keys.reply("t:r1"))
        assert 0 < ttl <= replicas.cfg.session_ttl_s * 1000
        return
    await replicas.pass_ms(round(replicas.cfg.session_ttl_s * 1000) + 1)
    await a.save_reply("t:r3", "t/anon/4@a")  # prunes the expired
    assert [await b.load_reply("t:r1"), await b.load_reply("t:r3")] == [None, "t/anon/4@a"]
    assert list(replicas.state.replies) == ["t:r3"]


async def test_release_wakes_other_replicas(replicas: Replicas) -> None:
    a, b = await replicas.new(), await replicas.new()
    assert await a.try_admit("w1", "s", 1, replicas.clock())
    assert await a.try_admit("w1", "t", 2, replicas.clock())
    await asyncio.sleep(0.1)  # b's subscription is live (subscribing wakes once by itself)
    wake = b.wakeups()
    waiter = asyncio.ensure_future(wake.__anext__())
    await a.release("w1", "t")  # nobody waits in the queue: no wake-up needed
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await b.enqueue("waiting", 1.0)
    await a.release("w1", "s")
    await asyncio.wait_for(waiter, 2)
    waiter = asyncio.ensure_future(wake.__anext__())
    await a.notify()
    await asyncio.wait_for(waiter, 2)
    await wake.aclose()


async def test_health_and_replica_count(replicas: Replicas) -> None:
    a, b = await replicas.new(), await replicas.new()
    await a.renew(replicas.clock())
    await b.renew(replicas.clock())
    await a.renew(replicas.clock())
    assert a.up and a.failures_total == 0
    assert a.mode == ("shared" if replicas.backend == "redis" else "memory")
    assert a.live_replicas == 2


async def test_a_claimed_session_moves_and_its_old_replica_learns_once(
    replicas: Replicas,
) -> None:
    a, b = await replicas.new(), await replicas.new()
    now = replicas.clock()
    assert await a.try_admit("w1", "t/id/s", 2, now)
    await a.save_session("t/id/s", {"worker": "w1", "turns": 3})
    assert await b.claim("w1", "t/id/s", now)  # b adopts it: same lease, not a new one
    assert await a.admitted("w1") == 1
    await a.renew(replicas.clock())
    assert a.drain_lost() == [("w1", "t/id/s")]
    assert a.drain_lost() == []  # reported once
    assert b.drain_lost() == []
    # a's idle timeout must not end a session b serves now: fenced.
    assert await a.release("w1", "t/id/s") is False
    assert await b.admitted_sessions("w1") == ["t/id/s"]
    await b.save_session("t/id/s", {"worker": "w1", "turns": 4})
    # Nor may a's older turns overwrite b's record before a's heartbeat: fenced too.
    await a.save_session("t/id/s", {"worker": "w1", "turns": 3})
    assert await b.load_session("t/id/s") == {"worker": "w1", "turns": 4}
    replicas.clock.advance(LEASE_MS - 1000)  # lease times follow the injected clock
    await b.renew(replicas.clock())  # b renews it now; a does not
    replicas.clock.advance(2000)
    assert await b.admitted_sessions("w1") == ["t/id/s"]
    assert await b.release("w1", "t/id/s") is True  # ends it: lease and record, once
    assert await b.release("w1", "t/id/s") is False
    assert await a.admitted("w1") == 0
    assert await a.load_session("t/id/s") is None


async def test_claim_needs_a_live_lease(replicas: Replicas) -> None:
    a, b = await replicas.new(), await replicas.new()
    assert not await b.claim("w1", "t/id/never", replicas.clock())
    assert await a.try_admit("w1", "t/id/old", 5, replicas.clock())
    replicas.clock.advance(LEASE_MS + 1)  # a died: nobody renewed it
    assert not await b.claim("w1", "t/id/old", replicas.clock())
    assert await b.admitted("w1") == 0


async def test_delete_elsewhere_ends_the_session_wherever_it_lives(replicas: Replicas) -> None:
    a, b = await replicas.new(), await replicas.new()
    assert await a.try_admit("w1", "t/id/s", 2, replicas.clock())
    await a.save_session("t/id/s", {"worker": "w1"})
    results = await asyncio.gather(
        b.release("w1", "t/id/s", any_owner=True), b.release("w1", "t/id/s", any_owner=True)
    )
    assert sorted(results) == [False, True]  # the slot is freed exactly once
    assert await b.load_session("t/id/s") is None
    await a.renew(replicas.clock())
    assert a.drain_lost() == [("w1", "t/id/s")]
    replicas.clock.advance(1000)
    await a.renew(replicas.clock())  # renewal does not bring it back
    assert await a.admitted("w1") == 0


async def test_ranked_admission_can_enqueue_in_the_same_step(replicas: Replicas) -> None:
    a, b = await replicas.new(), await replicas.new()
    now = replicas.clock()
    await a.enqueue("older", 1.0)
    # "newer" joins the queue behind "older" and is refused (rank 1, one free slot) ...
    assert not await b.admit_if_ranked("newer", 1, "w1", 10, now, score=2.0)
    assert await b.queue_rank("newer") == 1
    assert not await b.admit_if_ranked("newer", 1, "w1", 10, now, score=2.0)  # no second entry
    assert await a.queue_len() == 2
    # ... until "older" goes; an admitted session is not queued again by a late ask.
    assert await a.admit_if_ranked("older", 1, "w1", 10, now, score=1.0)
    assert await b.admit_if_ranked("newer", 1, "w1", 10, now, score=2.0)
    assert await b.admit_if_ranked("newer", 1, "w1", 10, now, score=2.0)
    assert await a.queue_len() == 0
    assert await a.admitted_counts(["w1", "w2"]) == {"w1": 2, "w2": 0}


async def test_a_session_leased_on_another_worker_takes_no_second_lease(
    replicas: Replicas,
) -> None:
    a, b = await replicas.new(), await replicas.new()
    now = replicas.clock()
    assert await a.admit_if_ranked("t/id/x", 1, "w1", 10, now, score=1.0, others=["w0", "w1"])
    # b asks for it on w0 with a free slot: it is held on w1 already, so b gets that worker
    # and the session leaves the queue instead of taking a slot on w0.
    got = await b.admit_if_ranked("t/id/x", 1, "w0", 10, now, score=2.0, others=["w0", "w1"])
    assert got == HeldElsewhere("w1") and not got
    assert await b.admitted_counts(["w0", "w1"]) == {"w0": 0, "w1": 1}
    assert await b.queue_rank("t/id/x") is None
    assert await b.claim("w1", "t/id/x", now)  # what the gateway does with the answer
    # Without others, or once that lease expired, w0 admits it (nothing else knows of it).
    assert await b.admit_if_ranked("t/id/x", 1, "w0", 10, now, score=2.0) is True
    replicas.clock.advance(LEASE_MS + 1)
    later = replicas.clock()
    assert await a.admit_if_ranked("t/id/y", 1, "w1", 10, later, score=1.0, others=["w0"])
    replicas.clock.advance(LEASE_MS + 1)
    assert await b.admit_if_ranked("t/id/y", 1, "w0", 10, replicas.clock(), score=1.0,
                                   others=["w0", "w1"]) is True
