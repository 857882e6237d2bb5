"""Redis stops and comes back under each ``on_store_failure`` mode, seen through the gateway.

One replica, a window of 2, one session holding a slot; Redis (a private server) is killed,
three new sessions arrive, Redis starts again (empty: no persistence). What docs/admission.md
says per mode is checked here, and that no admitted session is lost: after recovery the store
holds exactly the sessions the replica holds. Waits are bounded polls.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

_Factory = Any


async def _store(s: Any) -> dict[str, Any]:
    return (await s.state())["admission"]["store"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["local", "closed", "open"])
async def test_store_outage(make_stack: _Factory, private_redis: Any, mode: str) -> None:
    s = await make_stack(window=2, store={
        "backend": "redis", "redis_url": private_redis.url, "pool": f"outage-{mode}",
        "on_store_failure": mode, "lease_ttl_s": 2.0, "heartbeat_interval_s": 0.5,
        "leader_ttl_s": 1.0, "op_timeout_s": 0.2, "reconnect_interval_s": 0.2,
    })
    assert (await s.chat("holder"))[0] == 200
    private_redis.kill()

    async def down() -> bool:
        st = await _store(s)
        return st["up"] is False and st["mode"] == mode

    await s.until(down)
    news = [asyncio.create_task(s.chat(f"new{i}")) for i in range(3)]
    if mode == "closed":  # nothing new is admitted: 503 at once, with the reason
        for t in news:
            status, headers, body = await asyncio.wait_for(t, 10)
            assert status == 503 and body["error"]["code"] == "store_unavailable"
            assert int(headers["Retry-After"]) >= 1
        expected_held = 1
    else:  # local: this replica's share of the last limit (2 // 1 replica); open: its window
        await s.until(lambda: _count_done(news, 1))
        assert await s.queue_length() == 2
        assert [t.result()[0] for t in news if t.done()] == [200]
        expected_held = 2
    assert (await s.chat("holder"))[0] == 200  # continuations go on while Redis is away

    private_redis.start()

    async def resynced() -> bool:
        row = (await s.state())["admission"]["workers"]["w0"]
        return bool((await _store(s))["up"]) and row["admitted_store"] == expected_held

    await s.until(resynced)  # the empty Redis got this replica's leases back: none lost
    assert (await s.state())["admission"]["workers"]["w0"]["admitted"] == expected_held
    assert (await s.chat("holder", final=True))[0] == 200
    waiting = [t for t in news if not t.done()]
    if waiting:  # the freed slot goes to a waiting session once the store confirms it
        await s.until(lambda: _count_done(waiting, 1))


async def _count_done(tasks: list[asyncio.Task[Any]], n: int) -> bool:
    return sum(1 for t in tasks if t.done()) >= n
