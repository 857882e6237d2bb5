"""A proxy replica is SIGKILLed while holding sessions (two replicas, one private Redis).

Documented outcome (docs/admission.md, docs/reliability.md): the dead replica's leases are not
renewed and expire within one ``store.lease_ttl_s``; the surviving replica's waiting sessions
then take the freed slots. A session of the dead replica that calls the survivor while its
lease is live is adopted there at once (the survivor claims the lease on the same worker);
after the lease expired it is admitted there as a new session.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from marsproxy.bench.procs import RedisServer
from marsproxy.gateway.shells.sessions import unscoped_id
from tests.faults.conftest import Lab, Proxy, bounded, call, redis_leases, until

pytestmark = pytest.mark.timeout(60)

WORKERS = ["w0", "w1"]
WINDOW = 2
LIMIT = WINDOW * len(WORKERS)
LEASE_TTL_S = 2.0
HEARTBEAT_S = 0.5


async def _pair(lab: Lab, pool: str,
                lease_ttl_s: float = LEASE_TTL_S) -> tuple[RedisServer, Proxy, Proxy]:
    rs = lab.redis()
    workers = {w: lab.emulator(w) for w in WORKERS}
    cfg = lab.config(workers, {
        "admission": {"window_init": WINDOW, "window_min": WINDOW, "window_max": WINDOW},
        "store": {"backend": "redis", "redis_url": rs.url, "pool": pool,
                  "lease_ttl_s": lease_ttl_s, "heartbeat_interval_s": HEARTBEAT_S,
                  "leader_ttl_s": 1.0, "op_timeout_s": 0.3},
    })
    return rs, lab.proxy(cfg, "a"), lab.proxy(cfg, "b")


async def _owners(rs: RedisServer, pool: str) -> dict[str, str]:
    """Live lease → owning replica id, all workers together."""
    leases = await asyncio.to_thread(redis_leases, rs.url, pool, WORKERS)
    return {unscoped_id(s): owner for per in leases.values() for s, owner in per.items()}


async def _fill(a: Proxy) -> list[str]:
    holders = [f"holder-{i}" for i in range(LIMIT)]  # A takes every slot and keeps them
    for s in holders:
        assert (await call(a.http, a.url, s)).status == 200
    return holders


async def test_killed_replica_slots_come_back_within_a_lease_ttl(lab: Lab) -> None:
    rs, a, b = await _pair(lab, "replica-kill")
    holders = await _fill(a)
    owners = await _owners(rs, "replica-kill")
    assert len(owners) == LIMIT and len(set(owners.values())) == 1, owners
    newcomers = [asyncio.create_task(call(b.http, b.url, f"new-{i}", final=True))
                 for i in range(2)]
    await asyncio.sleep(LEASE_TTL_S / 2)
    assert not any(t.done() for t in newcomers)  # B's sessions wait: A holds the window

    t0 = time.monotonic()
    a.svc.kill()
    await until(lambda: _owners(rs, "replica-kill"), lambda o: len(o) <= 2,
                "the dead replica's leases expire", LEASE_TTL_S + 2 * HEARTBEAT_S + 1)
    freed_after = time.monotonic() - t0
    results = await bounded(asyncio.gather(*newcomers), LEASE_TTL_S + 3, "B's newcomers")
    assert [r.status for r in results] == [200, 200]
    assert freed_after <= LEASE_TTL_S + 1.5, freed_after

    # A's sessions go on at B (admitted there like new ones), and end cleanly.
    for s in holders:
        r = await bounded(call(b.http, b.url, s), LEASE_TTL_S + 5, f"{s} on the survivor")
        assert r.status == 200, r.body
    for s in holders:
        assert (await call(b.http, b.url, s, final=True)).status == 200
    await until(lambda: _owners(rs, "replica-kill"), lambda o: o == {}, "every lease released", 3)
    await until(b.admitted, lambda adm: sum(adm.values()) == 0, "B's slots released", 3)


async def test_killed_replica_sessions_continue_on_another_replica_at_once(lab: Lab) -> None:
    # Leases long enough that none of A's can expire during the test, however slow the
    # machine: B adopting A's session (not admitting it anew after the expiry) shows in the
    # leases below, A's others still live, not in a deadline on B's answer.
    rs, a, b = await _pair(lab, "replica-adopt", lease_ttl_s=30.0)
    holders = await _fill(a)
    dead = (await _owners(rs, "replica-adopt"))[holders[0]]
    a.svc.kill()
    # B continues A's session on the same slot while A's lease is live.
    r = await bounded(call(b.http, b.url, holders[0]), 10, "adopted session")
    assert r.status == 200
    owners = await _owners(rs, "replica-adopt")
    assert len(owners) == LIMIT  # taken over, not added: nothing counted twice
    assert owners[holders[0]] != dead  # the lease is the survivor's now


def _queued(url: str, pool: str) -> int:
    import redis

    r = redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=1)
    try:
        return int(r.zcard(f"mars:{{{pool}}}:queue"))
    finally:
        r.close()


async def test_a_killed_replicas_waiting_sessions_do_not_hold_the_global_queue(lab: Lab) -> None:
    rs, a, b = await _pair(lab, "replica-queue")
    holders = await _fill(a)
    # B's newcomers wait in the store's global queue (A holds every slot) ...
    waiting = [asyncio.create_task(call(b.http, b.url, f"b-{i}")) for i in range(LIMIT)]
    await until(lambda: asyncio.to_thread(_queued, rs.url, "replica-queue"),
                lambda n: n == LIMIT, "B's sessions wait in the global queue", 10)
    b.svc.kill()  # ... when B dies: nobody will ever ask for them again
    await asyncio.gather(*waiting, return_exceptions=True)
    for s in holders:
        assert (await call(a.http, a.url, s, final=True)).status == 200
    # Every slot is free: A's next session is admitted, not ranked behind the dead entries
    # for good. A batch session ranks behind every interactive one, so behind all of B's
    # entries: an interactive one's place among them hung on the tenant counter each replica
    # had read when it last asked, and one ranked ahead was admitted past dead entries that
    # then stayed (nobody asked behind them).
    r = await bounded(call(a.http, a.url, "after", cls="batch"), LEASE_TTL_S + 10,
                      "A's new session")
    assert r.status == 200, r.body
    await until(lambda: asyncio.to_thread(_queued, rs.url, "replica-queue"),
                lambda n: n == 0, "the dead entries leave the global queue", 10)
