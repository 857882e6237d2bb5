"""Two gateways (replicas) in one process, in front of the same emulated workers, sharing a
private redis-server: a session waiting for a full worker moves to one with room, and an
adopted session's record carries its service and estimates. Waits are bounded polls.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis.asyncio as aioredis

_Factory = Any
# A generous op timeout: on a loaded machine a 0.5 s one expired, and the local fallback it
# switched to decides without the other replica's leases (not what these tests are about).
STORE = {"lease_ttl_s": 2.0, "heartbeat_interval_s": 0.2, "leader_ttl_s": 1.0,
         "op_timeout_s": 2.0, "reconnect_interval_s": 0.2}


def _where(state: dict[str, Any], session: str) -> str | None:
    for w, row in state["admission"]["workers"].items():
        if session in row["sessions"]:
            return str(w)
    return None


async def test_a_pending_session_moves_to_a_worker_with_global_room(
    make_stack: _Factory, private_redis: Any
) -> None:
    store = {"backend": "redis", "redis_url": private_redis.url, "pool": "move"} | STORE
    a = await make_stack(workers=2, window=1, store=store)
    b = await make_stack(window=1, store=store, share=a)
    assert (await a.chat("first"))[0] == 200
    # Both workers look alike, so every core places a new session on w0 first.
    assert _where(await a.state(), "first") == "w0"
    # b's core sees w0 free (the session is a's) and proposes w0; the store refuses (w0 is
    # full across replicas) while w1 has room: it moves there instead of waiting.
    status, _, _ = await asyncio.wait_for(b.chat("second"), 5)
    assert status == 200
    assert _where(await b.state(), "second") == "w1"
    row = (await b.state())["admission"]["workers"]
    assert row["w0"]["admitted"] == 0 and row["w1"]["admitted"] == 1


async def test_the_record_carries_the_session_to_the_next_replica(
    make_stack: _Factory, private_redis: Any
) -> None:
    store = {"backend": "redis", "redis_url": private_redis.url, "pool": "carry"} | STORE
    a = await make_stack(workers=1, window=1, store=store)
    b = await make_stack(window=1, store=store, share=a)
    assert (await a.chat("s", content="hello " * 200))[0] == 200
    r = aioredis.Redis.from_url(private_redis.url, decode_responses=True)
    try:
        key = "mars:{carry}:sess:anon/id/s"

        async def recorded() -> dict[str, Any] | None:
            raw = await r.get(key)
            return None if raw is None else dict(json.loads(raw))

        for _ in range(500):  # up to 10 s: the save is a task of its own on a busy machine
            rec = await recorded()
            if rec is not None and rec.get("attained_tokens"):
                break  # the record saved after the call (the one at admission has no usage)
            await asyncio.sleep(0.02)
        assert rec is not None and rec["worker"] == "w0" and rec["turns"] == 1
        assert rec["attained_tokens"] > 200 and rec["correction"] != 1.0
        # The window is full (1), yet b serves the session's next turn at once.
        assert (await asyncio.wait_for(b.chat("s", content="hello " * 210), 5))[0] == 200
        rec2 = None
        for _ in range(500):  # up to 10 s: the save is a task of its own on a busy machine
            rec2 = await recorded()
            if rec2 is not None and rec2["turns"] == 2:
                break
            await asyncio.sleep(0.02)
        assert rec2 is not None and rec2["turns"] == 2
        assert rec2["attained_tokens"] > rec["attained_tokens"]
        assert rec2["replica"] != rec["replica"]
        assert (await b.chat("s", final=True))[0] == 200
        for _ in range(500):  # up to 10 s: the save is a task of its own on a busy machine
            if await r.get(key) is None:
                break
            await asyncio.sleep(0.02)
        assert await r.get(key) is None  # ended: the record is gone with the lease
        assert await r.zcard("mars:{carry}:adm:w0") == 0
    finally:
        await r.aclose()


async def test_tokenize_counts_a_new_sessions_first_prompt(make_stack: _Factory) -> None:
    padding = {"user": "x" * 4000, "metadata": {"note": "y" * 4000}}  # not prompt text
    for tokenize in (False, True):
        s = await make_stack(window=1, tokenize=tokenize)
        assert (await s.chat("holder"))[0] == 200  # the window is full now
        body = {"model": "tiny-emulated", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hello " * 100}]} | padding
        waiting = asyncio.create_task(s.http.post(
            s.url("/v1/chat/completions"), json=body, headers={"x-session-id": "new"}))
        core = s.proxy.gateway.admission.core
        for _ in range(200):
            entry = core.queue.get("anon/id/new")
            if entry is not None:
                break
            await asyncio.sleep(0.02)
        assert entry is not None
        async with s.http.post(s.url("/tokenize"), json={
            "model": "tiny-emulated", "messages": body["messages"]}) as r:
            exact = (await r.json())["count"]
        if tokenize:
            assert entry.est_tokens == exact
        else:  # characters / 4 of the whole body, padding included
            assert entry.est_tokens > exact + 1500
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)


async def test_an_idle_timeout_on_the_replica_a_session_left_does_not_end_it(
    make_stack: _Factory, private_redis: Any
) -> None:
    # Slow heartbeats: a's core times the session out before a learns that it moved.
    store = {"backend": "redis", "redis_url": private_redis.url, "pool": "idle",
             "lease_ttl_s": 6.0, "heartbeat_interval_s": 2.5, "leader_ttl_s": 1.0}
    a = await make_stack(workers=1, window=1, store=store, idle_timeout_min_s=0.3)
    b = await make_stack(window=1, store=store, share=a, idle_timeout_min_s=30.0)
    assert (await a.chat("s"))[0] == 200
    assert (await b.chat("s"))[0] == 200  # b adopts it: its lease, now b's
    r = aioredis.Redis.from_url(private_redis.url, decode_responses=True)
    try:
        async def a_ended_it() -> bool:
            return not (await a.state())["admission"]["workers"]["w0"]["sessions"]

        await a.until(a_ended_it, 5)  # a's idle timeout fired ...
        await asyncio.sleep(0.2)
        # ... and ended nothing: the lease and the record are b's, alive.
        assert await r.zrange("mars:{idle}:adm:w0", 0, -1) == ["anon/id/s"]
        assert await r.get("mars:{idle}:sess:anon/id/s") is not None
        assert (await b.chat("s", final=True))[0] == 200
        for _ in range(500):  # up to 10 s: the save is a task of its own on a busy machine
            if await r.zcard("mars:{idle}:adm:w0") == 0:
                break
            await asyncio.sleep(0.02)
        assert await r.zcard("mars:{idle}:adm:w0") == 0
    finally:
        await r.aclose()
