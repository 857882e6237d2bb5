"""One policy across two replicas on one private redis-server: service classes, tenant shares
and agent trees order the store's global queue, not arrival; a Redis outage degrades to each
replica's local counters and leaks no slot.

Replica ``a`` leads (it starts first) and publishes its window of 1 (2 for the tree case) as the
limit the store enforces; ``b``'s own window is one larger, so its core proposes a session the
store then refuses: that session waits in the global queue, where the order is decided. With
arrival order, the session of ``a`` (it arrived first) would win each time. Waits are bounded
polls.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from tests.integration.admission.conftest import Stack, StackFactory

STORE = {"lease_ttl_s": 2.0, "heartbeat_interval_s": 0.2, "leader_ttl_s": 1.0,
         "op_timeout_s": 0.5, "reconnect_interval_s": 0.2}


async def _chat(s: Stack, session: str, *, key: str = "k", cls: str | None = None,
                parent: str | None = None, final: bool = False,
                content: str = "hi") -> tuple[int, dict[str, Any]]:
    headers = {"x-session-id": session, "Authorization": f"Bearer {key}"}
    if cls is not None:
        headers["x-session-class"] = cls
    if parent is not None:
        headers["x-parent-session-id"] = parent
    if final:
        headers["x-session-final"] = "true"
    body = {"model": "tiny-emulated", "messages": [{"role": "user", "content": content}],
            "max_tokens": 4}
    async with s.http.post(s.url("/v1/chat/completions"), json=body, headers=headers) as r:
        return r.status, await r.json()


async def _pair(make_stack: StackFactory, url: str, pool: str, window: int = 1,
                **store: Any) -> tuple[Stack, Stack]:
    cfg = {"backend": "redis", "redis_url": url, "pool": pool} | STORE | store
    a = await make_stack(workers=1, window=window, store=cfg)

    async def leads() -> bool:
        st = (await a.state())["admission"]["store"]
        return bool(st["is_leader"])

    await a.until(leads)
    b = await make_stack(window=window + 1, store=cfg, share=a)

    async def b_sees_limit() -> bool:  # b read a's published window (and a's leases)
        return (await b.state())["admission"]["store"]["up"] is True

    await b.until(b_sees_limit)
    return a, b


async def _queued(s: Stack, n: int) -> bool:
    return await s.queue_length() == n


async def _race(first: asyncio.Task[Any], second: asyncio.Task[Any]) -> None:
    """``first`` is admitted while ``second`` still waits."""
    assert (await asyncio.wait_for(first, 10))[0] == 200
    assert not second.done()


async def test_interactive_goes_ahead_of_an_earlier_batch_session_of_another_replica(
    make_stack: StackFactory, private_redis: Any
) -> None:
    a, b = await _pair(make_stack, private_redis.url, "classes")
    assert (await _chat(a, "holder"))[0] == 200
    batch = asyncio.create_task(_chat(a, "bt", cls="batch"))
    await a.until(lambda: _queued(a, 1))  # waits in a's core (a's window is full)
    inter = asyncio.create_task(_chat(b, "it", cls="interactive"))
    await b.until(lambda: _queued(b, 1))  # pending in the store's global queue
    assert (await _chat(a, "holder", final=True))[0] == 200
    # a's core proposes the batch session at once; the store ranks it behind "it".
    await _race(inter, batch)
    assert (await _chat(b, "it", final=True))[0] == 200
    assert (await asyncio.wait_for(batch, 10))[0] == 200


async def test_the_light_tenant_goes_ahead_of_the_heavy_one_across_replicas(
    make_stack: StackFactory, private_redis: Any
) -> None:
    a, b = await _pair(make_stack, private_redis.url, "tenants")
    for i in range(10):  # the heavy tenant is served on a: its counter grows in the store
        assert (await _chat(a, f"h{i}", key="heavy", content="tokens " * 200, final=True))[0] \
            == 200
    r = aioredis.Redis.from_url(private_redis.url, decode_responses=True)
    try:
        async def charged() -> bool:
            got = await r.hgetall("mars:{tenants}:tenants")
            return len(got) == 1 and float(next(iter(got.values()))) > 100
        await a.until(charged)
        assert (await _chat(a, "holder", key="heavy"))[0] == 200
        heavy = asyncio.create_task(_chat(a, "hn", key="heavy"))
        await a.until(lambda: _queued(a, 1))
        light = asyncio.create_task(_chat(b, "ln", key="light"))
        await b.until(lambda: _queued(b, 1))
        assert (await _chat(a, "holder", key="heavy", final=True))[0] == 200
        await _race(light, heavy)  # by served tokens, not by arrival
        assert (await _chat(b, "ln", key="light", final=True))[0] == 200
        assert (await asyncio.wait_for(heavy, 10))[0] == 200

        async def both() -> bool:  # b sends the light tenant's charges at its next tick
            return len(await r.hgetall("mars:{tenants}:tenants")) == 2
        await b.until(both)
    finally:
        await r.aclose()


async def test_a_child_of_a_parent_on_the_other_replica_goes_ahead_of_a_new_session(
    make_stack: StackFactory, private_redis: Any
) -> None:
    a, b = await _pair(make_stack, private_redis.url, "trees", window=2)
    assert (await _chat(a, "parent"))[0] == 200
    assert (await _chat(a, "holder"))[0] == 200
    plain = asyncio.create_task(_chat(a, "new"))
    await a.until(lambda: _queued(a, 1))
    child = asyncio.create_task(_chat(b, "child", parent="parent"))
    await b.until(lambda: _queued(b, 1))
    assert (await _chat(a, "holder", final=True))[0] == 200
    await _race(child, plain)
    assert (await _chat(b, "child", final=True))[0] == 200
    assert (await asyncio.wait_for(plain, 10))[0] == 200


async def test_a_redis_outage_keeps_local_counters_and_leaks_no_slot(
    make_stack: StackFactory, private_redis: Any
) -> None:
    cfg = {"backend": "redis", "redis_url": private_redis.url, "pool": "down",
           "on_store_failure": "local"} | STORE | {"op_timeout_s": 0.2}
    a = await make_stack(workers=1, window=2, store=cfg)
    b = await make_stack(window=2, store=cfg, share=a)
    assert (await _chat(a, "sa", key="t1"))[0] == 200
    assert (await _chat(b, "sb", key="t2"))[0] == 200

    async def two(s: Stack) -> bool:
        return int((await s.state())["admission"]["store"]["live_replicas"]) == 2

    await a.until(lambda: two(a))  # its share while down is a half of the limit
    private_redis.kill()

    async def down(s: Stack) -> bool:
        return (await s.state())["admission"]["store"]["up"] is False

    await a.until(lambda: down(a))
    await b.until(lambda: down(b))
    # local: each replica's share of the limit (2 // 2 replicas = 1) is taken: the new waits.
    new = asyncio.create_task(_chat(a, "na", key="t1"))
    await a.until(lambda: _queued(a, 1))
    # Continuations go on and are charged to the local counters meanwhile.
    assert (await _chat(a, "sa", key="t1", content="tokens " * 100))[0] == 200
    assert not new.done()
    private_redis.start()

    async def resynced() -> bool:
        sa, sb = await a.state(), await b.state()
        return bool(sa["admission"]["store"]["up"] and sb["admission"]["store"]["up"]
                    and sa["admission"]["workers"]["w0"]["admitted_store"] == 2)

    await a.until(resynced)  # both leases written back to the empty Redis: none lost
    r = aioredis.Redis.from_url(private_redis.url, decode_responses=True)
    try:
        async def flushed() -> bool:  # the charges made while down reached the store
            got = await r.hgetall("mars:{down}:tenants")  # Redis restarted empty
            return any(float(v) > 0 for v in got.values())
        await a.until(flushed)
        assert (await _chat(b, "sb", key="t2", final=True))[0] == 200
        assert (await asyncio.wait_for(new, 10))[0] == 200  # the freed slot goes to "na"
        for s, sess, key in ((a, "sa", "t1"), (a, "na", "t1")):
            assert (await _chat(s, sess, key=key, final=True))[0] == 200

        async def empty() -> bool:
            return int(await r.zcard("mars:{down}:adm:w0")) == 0
        await a.until(empty)  # every slot came back
        assert await a.admitted() == 0 and await b.admitted() == 0
    finally:
        await r.aclose()



async def test_a_plain_clients_finished_tasks_take_no_slot_in_the_store(
    make_stack: StackFactory, private_redis: Any
) -> None:
    # Each task its own session, one call, no final flag: its lease lives until the idle
    # timeout (60 s). Once its API key's record says its sessions do not come back (here after
    # one, not back within 0.3 s), a finished task holds no slot. The store counts every lease;
    # the limit it is asked to enforce counts this replica's slotless sessions on top, so a
    # window of 2 lets every next task in.
    cfg = {"backend": "redis", "redis_url": private_redis.url, "pool": "tasks"} | STORE
    a = await make_stack(workers=1, window=2, store=cfg, return_history=1, kv_hold_min_s=0.3)

    async def leads() -> bool:
        return bool((await a.state())["admission"]["store"]["is_leader"])

    async def judged() -> bool:  # task0 did not come back within its hold
        return list((await a.state())["admission"]["returns"].values()) == [[0, 1, 0]]

    await a.until(leads)
    assert (await _chat(a, "task0"))[0] == 200
    await a.until(judged)
    for i in range(1, 6):
        status, _ = await asyncio.wait_for(_chat(a, f"task{i}"), 10)
        assert status == 200

    async def six_leases() -> bool:  # each a live lease still (the store is told after)
        (w,) = (await a.state())["admission"]["workers"].values()
        return bool(w["admitted_store"] == 6 == w["admitted"] and w["held"] == 0)

    await a.until(six_leases)
