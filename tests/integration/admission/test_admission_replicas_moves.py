"""Two gateways (replicas) in one process sharing a private redis-server, with a load balancer
without affinity: a session's calls alternate between them faster than one heartbeat, so the
replica a session just left still believes it holds it. Waits are bounded polls.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

_Factory = Any
# Slow heartbeats: a replica learns that a session moved away only seconds later.
STORE = {"backend": "redis", "lease_ttl_s": 6.0, "heartbeat_interval_s": 2.5,
         "leader_ttl_s": 1.0, "op_timeout_s": 2.0, "reconnect_interval_s": 0.2}


async def _pair(make_stack: _Factory, url: str, pool: str, workers: int,
                window: int) -> tuple[Any, Any, aioredis.Redis]:
    """Replicas a and b on one pool, and a client of its Redis."""
    store = STORE | {"redis_url": url, "pool": pool}
    a = await make_stack(workers=workers, window=window, store=store, idle_timeout_min_s=30.0)
    b = await make_stack(window=window, store=store, share=a, idle_timeout_min_s=30.0)
    return a, b, aioredis.Redis.from_url(url, decode_responses=True)


async def _gone(r: aioredis.Redis, key: str, within: float) -> bool:
    for _ in range(int(within / 0.02)):
        if await r.zcard(key) == 0:
            return True
        await asyncio.sleep(0.02)
    return False


async def test_a_final_turn_on_the_replica_a_session_just_left_ends_it(
    make_stack: _Factory, private_redis: Any
) -> None:
    a, b, r = await _pair(make_stack, private_redis.url, "final-left", workers=1, window=1)
    try:
        assert (await a.chat("s"))[0] == 200
        assert (await b.chat("s"))[0] == 200  # b adopts it: the lease is b's now
        # Back on a before a's heartbeat noticed the move: a still holds it in its core.
        assert (await a.chat("s", final=True))[0] == 200
        # The session is over for its client: its slot comes back, not at b's idle timeout.
        assert await _gone(r, "mars:{final-left}:adm:w0", 4.0)
        assert await r.get("mars:{final-left}:sess:anon/id/s") is None
        # And the next session is admitted at once.
        assert (await asyncio.wait_for(b.chat("next"), 5))[0] == 200
    finally:
        await r.aclose()


async def test_one_new_session_started_on_two_replicas_at_once_holds_one_lease(
    make_stack: _Factory, private_redis: Any
) -> None:
    a, b, r = await _pair(make_stack, private_redis.url, "twice", workers=2, window=2)
    try:
        assert (await a.chat("holder"))[0] == 200  # a places its next session on w1, b on w0
        # A harness's side request and its first call, sent at once, reach both replicas.
        assert [s for s, _, _ in await asyncio.gather(a.chat("x"), b.chat("x"))] == [200, 200]
        leases = [await r.zrange(f"mars:{{twice}}:adm:{w}", 0, -1) for w in ("w0", "w1")]
        assert sum(s.count("anon/id/x") for s in leases) == 1, leases
    finally:
        await r.aclose()
