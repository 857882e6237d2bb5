"""The in-memory store with an injected clock: lease boundaries, heartbeat, records' TTL,
wake-ups, and a property test of the admission invariant."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from marsproxy.aimd.stores import MemoryState, MemoryStore, StoreConfig


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


CFG = StoreConfig(lease_ttl_s=10, heartbeat_interval_s=2, leader_ttl_s=5, session_ttl_s=60)


async def test_a_lease_ends_exactly_at_its_expiry() -> None:
    clock = Clock()
    s = MemoryStore(CFG, clock=clock)
    assert await s.try_admit("w", "a", 1, clock.now)
    clock.now += 9_999
    assert not await s.try_admit("w", "b", 1, clock.now) and await s.admitted("w") == 1
    clock.now += 1
    assert await s.admitted("w") == 0
    assert await s.try_admit("w", "b", 1, clock.now)


async def test_a_lone_stores_leases_outlive_a_late_heartbeat() -> None:
    # One replica: a heartbeat late past the TTL (a stalled event loop) loses nothing, and the
    # lease still counts; releasing it is what ends it.
    clock = Clock()
    s = MemoryStore(CFG, clock=clock, lone=True)
    assert await s.try_admit("w", "a", 1, clock.now)
    clock.now += 60_000
    assert s.renew_sync(clock.now) == 1 and s.drain_lost() == []
    assert await s.admitted_sessions("w") == ["a"] and not await s.try_admit("w", "b", 1, clock.now)
    assert await s.release("w", "a") and await s.admitted("w") == 0
    # Shared (replicas), the same late heartbeat reports the lease lost.
    shared = MemoryStore(CFG, clock=clock)
    assert await shared.try_admit("w", "a", 1, clock.now)
    clock.now += 60_000
    shared.renew_sync(clock.now)
    assert shared.drain_lost() == [("w", "a")] and await shared.admitted("w") == 0


async def test_background_heartbeat_renews_own_leases() -> None:
    clock = Clock()
    cfg = StoreConfig(lease_ttl_s=0.1, heartbeat_interval_s=0.01)
    s = MemoryStore(cfg, clock=clock)
    await s.start()
    try:
        assert await s.try_admit("w", "a", 1, clock.now)
        for _ in range(5):
            clock.now += 60
            await asyncio.sleep(0.03)  # a few heartbeats at the new time
        assert await s.admitted_sessions("w") == ["a"]
    finally:
        await s.close()


async def test_session_records_expire_and_are_purged() -> None:
    clock = Clock()
    s = MemoryStore(CFG, clock=clock)
    await s.save_session("k1", {"worker": "w"})
    await s.save_session("k2", {"worker": "w"})
    clock.now += 59_999
    assert await s.load_session("k1") == {"worker": "w"}
    clock.now += 1
    assert await s.load_session("k1") is None
    await s.renew(clock.now)  # the heartbeat purges records nobody asks for again
    assert s.load_raw("k2") is None


async def test_queue_ties_break_by_name_like_a_redis_zset() -> None:
    s = MemoryStore(CFG, clock=Clock())
    for name in ("c", "a", "b"):
        await s.enqueue(name, 1.0)
    assert [await s.queue_rank(n) for n in ("a", "b", "c")] == [0, 1, 2]
    assert s.queue_items() == [("a", 1.0), ("b", 1.0), ("c", 1.0)]


async def test_wakeups_coalesce_and_reach_every_waiter() -> None:
    shared = MemoryState()
    a = MemoryStore(CFG, clock=Clock(), state=shared)
    b = MemoryStore(CFG, clock=Clock(), state=shared)
    w1, w2 = a.wakeups(), b.wakeups()
    t1, t2 = asyncio.ensure_future(w1.__anext__()), asyncio.ensure_future(w2.__anext__())
    await asyncio.sleep(0)
    for _ in range(3):
        await a.notify()
    await asyncio.wait_for(asyncio.gather(t1, t2), 1)
    t1 = asyncio.ensure_future(w1.__anext__())
    await asyncio.sleep(0.01)
    assert not t1.done()  # three notifications, one wake-up: the waiter re-checks once
    t1.cancel()
    await w2.aclose()


async def test_leader_lease_is_taken_over_only_after_it_expires() -> None:
    clock, shared = Clock(), MemoryState()
    a = MemoryStore(CFG, clock=clock, state=shared)
    b = MemoryStore(CFG, clock=clock, state=shared)
    assert await a.try_lead(clock.now) and not await b.try_lead(clock.now)
    clock.now += 4_999
    assert a.is_leader and not await b.try_lead(clock.now)
    clock.now += 1
    assert not a.is_leader and await b.try_lead(clock.now)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "release", "tick", "ranked"]),
        st.integers(0, 2),  # replica
        st.integers(0, 11),  # session
        st.integers(1, 6),  # limit
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_no_step_admits_beyond_the_limit(ops: list[tuple[str, int, int, int]]) -> None:
    async def run() -> None:
        clock, shared = Clock(), MemoryState()
        reps = [MemoryStore(CFG, clock=clock, state=shared) for _ in range(3)]
        for i in range(12):
            await reps[i % 3].enqueue(f"s{i}", float(i))
        left_queue: set[str] = set()
        for op, r, i, limit in ops:
            store, session = reps[r], f"s{i}"
            before = await store.admitted("w")
            if op == "admit":
                ok = await store.try_admit("w", session, limit, clock.now)
                assert not ok or before < limit or session in await store.admitted_sessions("w")
            elif op == "ranked":
                rank = await store.queue_rank(session)
                ok = await store.admit_if_ranked(session, 2, "w", limit, clock.now)
                assert not ok or rank is None or rank < 2
                if ok and rank is not None:
                    left_queue.add(session)
            elif op == "release":
                await store.release("w", session)
            else:
                clock.now += 4_000
                await reps[0].renew(clock.now)  # only replica 0 survives
            after = await store.admitted("w")
            assert after <= max(before, limit)  # admission never pushes past the limit
            # The queue loses a session only by its ranked admission, exactly once.
            assert await store.queue_len() + len(left_queue) == 12

    asyncio.run(run())


async def test_tenant_counters_add_up_across_stores_on_one_state() -> None:
    state = MemoryState()
    a = MemoryStore(StoreConfig(), state=state)
    b = MemoryStore(StoreConfig(), state=state)
    assert await a.exchange_counters({"t": 100.0}) == {"t": 100.0}
    assert await b.exchange_counters({"t": 50.0, "u": 1.0}) == {"t": 150.0, "u": 1.0}
    assert await a.exchange_counters({}) == {"t": 150.0, "u": 1.0}
