"""Redis killed and restarted, then slowed (``DEBUG SLEEP``), under load, in each
``store.on_store_failure`` mode; two replicas share a private redis-server.

Documented outcome (docs/admission.md, docs/reliability.md): ``local`` and ``open`` keep
admitting while Redis is away, ``closed`` answers new sessions 503 ``store_unavailable``;
in every mode the sessions already admitted go on (no admitted session is lost), and after
recovery the store's lease ZSETs hold exactly the sessions the replicas hold (no slot leaked,
none counted twice); once every session ended both are empty and stay empty.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import redis

from marsproxy.bench.procs import RedisServer
from marsproxy.gateway.shells.sessions import unscoped_id
from tests.faults.conftest import Lab, Load, Proxy, bounded, call, redis_leases, until

pytestmark = pytest.mark.timeout(60)

WORKERS = ["w0", "w1"]
WINDOW = 3
LEASE_TTL_S = 2.0
TURNS = 3


def _slow(url: str, seconds: float) -> None:
    r = redis.Redis.from_url(url, socket_timeout=seconds + 5)
    try:
        r.execute_command("DEBUG", "SLEEP", str(seconds))
    finally:
        r.close()


async def _store_leases(url: str, pool: str) -> dict[str, set[str]]:
    leases = await asyncio.to_thread(redis_leases, url, pool, WORKERS)
    return {w: {unscoped_id(s) for s in owners} for w, owners in leases.items()}


async def _replica_leases(proxies: list[Proxy]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {w: set() for w in WORKERS}
    counts: Counter[str] = Counter()
    for p in proxies:
        for w, ss in (await p.held_sessions()).items():
            out[w] |= ss
            counts[w] += len(ss)
    # A session held by two replicas at once would be counted twice.
    assert all(counts[w] == len(out[w]) for w in WORKERS), (counts, out)
    return out


async def _failures(p: Proxy) -> int:
    return int((await p.state())["admission"]["store"]["failures_total"])


async def _store_up(p: Proxy) -> bool:
    return bool((await p.state())["admission"]["store"]["up"])


@pytest.mark.parametrize("mode", ["local", "closed", "open"])
async def test_redis_killed_restarted_and_slowed_under_load(lab: Lab, mode: str) -> None:
    rs: RedisServer = lab.redis()
    pool = f"faults-{mode}"
    workers = {w: lab.emulator(w) for w in WORKERS}
    cfg = lab.config(workers, {
        "admission": {"window_init": WINDOW, "window_min": WINDOW, "window_max": WINDOW},
        "store": {"backend": "redis", "redis_url": rs.url, "pool": pool,
                  "on_store_failure": mode, "lease_ttl_s": LEASE_TTL_S,
                  "heartbeat_interval_s": 0.5, "leader_ttl_s": 1.0, "op_timeout_s": 0.2,
                  "reconnect_interval_s": 0.2},
    })
    proxies = [lab.proxy(cfg, "a"), lab.proxy(cfg, "b")]
    # Holders: admitted before the faults, idle through them, ended after recovery.
    holders = {f"holder-{i}": proxies[i % 2] for i in range(2)}
    for s, p in holders.items():
        assert (await call(p.http, p.url, s)).status == 200

    load = Load(TURNS)
    agents = [asyncio.create_task(load.agent(proxies[i % 2], f"{mode}-agent{i}"))
              for i in range(8)]
    await asyncio.sleep(0.8)
    rs.kill()
    await until(lambda: _store_up(proxies[0]), lambda up: not up, "outage noticed", 5)
    await asyncio.sleep(1.0)  # load runs on without Redis
    for s, p in holders.items():  # admitted sessions go on in every mode
        assert (await call(p.http, p.url, s)).status == 200, (mode, s)
    rs.start()  # empty: no persistence
    await until(lambda: _store_up(proxies[0]), bool, "recovery noticed", 5)
    await asyncio.sleep(0.8)
    before = [await _failures(p) for p in proxies]
    await asyncio.to_thread(_slow, rs.url, 1.0)  # every op times out meanwhile
    after = [await _failures(p) for p in proxies]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    await asyncio.sleep(0.8)
    load.stop.set()
    await bounded(asyncio.gather(*agents), 30, "agents after the faults")

    started = [o for o in load.outcomes if o]
    assert len(started) >= 16, len(started)  # the load really ran through the faults
    for calls in started:
        statuses = [s for s, _ in calls]
        if mode == "closed" and statuses[0] == 503:
            # Refused while the store was unreachable: before admission, with the reason.
            assert calls == [(503, "store_unavailable")], calls
        else:  # admitted sessions are never lost: every call of theirs was served
            assert statuses == [200] * TURNS, (mode, calls)
    refused = sum(1 for o in started if o[0][0] == 503)
    if mode == "closed":
        assert refused >= 1  # the outage was felt
    else:
        assert refused == 0

    # After recovery the store holds exactly what the replicas hold: the holders.
    for p in proxies:
        await until(lambda p=p: _store_up(p), bool, "both replicas back on Redis", 5)
    expect = {w: set() for w in WORKERS}  # type: dict[str, set[str]]
    for w, ss in (await _replica_leases(proxies)).items():
        expect[w] = ss
    assert sum(len(ss) for ss in expect.values()) == len(holders), expect
    await until(lambda: _store_leases(rs.url, pool), lambda got: got == expect,
                "store leases equal the replicas' own", 5)

    for s, p in holders.items():
        assert (await call(p.http, p.url, s, final=True)).status == 200
    empty: dict[str, set[str]] = {w: set() for w in WORKERS}
    await until(lambda: _store_leases(rs.url, pool), lambda got: got == empty,
                "every lease released", 3)
    await until(lambda: _replica_leases(proxies), lambda got: got == empty,
                "every replica slot released", 3)
    await asyncio.sleep(LEASE_TTL_S + 0.5)  # heartbeats and resyncs revive nothing
    assert await _store_leases(rs.url, pool) == empty
    for p in proxies:
        q = (await p.state())["admission"]["queue"]
        assert q["length"] == 0 and q["pending"] == 0, q


async def test_redis_restarted_between_two_ops_loses_no_admitted_session(lab: Lab) -> None:
    """A restart so quick that no op of the proxy failed (a supervisor restarting a crashed
    Redis; redis-py's pool reconnects silently): the next heartbeat finds the leases gone from
    the empty Redis. Documented outcome as for any restart: admitted sessions live on and their
    leases are written back; the proxy used to forget them all as if they had moved."""
    rs: RedisServer = lab.redis()
    pool = "faults-quick-restart"
    workers = {w: lab.emulator(w) for w in WORKERS}
    cfg = lab.config(workers, {
        # Few ops besides the heartbeat: the restart falls between two of them.
        "admission": {"window_init": WINDOW, "window_min": WINDOW, "window_max": WINDOW,
                      "tuning": {"control_interval_s": 1.0}},
        "store": {"backend": "redis", "redis_url": rs.url, "pool": pool,
                  "lease_ttl_s": LEASE_TTL_S, "heartbeat_interval_s": 0.5,
                  "leader_ttl_s": 2.0, "op_timeout_s": 0.2, "reconnect_interval_s": 0.2},
    })
    p = lab.proxy(cfg)
    holders = ["holder-0", "holder-1"]
    for s in holders:
        assert (await call(p.http, p.url, s)).status == 200
    held = await _replica_leases([p])
    assert sum(len(ss) for ss in held.values()) == len(holders), held
    await until(lambda: _store_leases(rs.url, pool), lambda got: got == held,
                "leases in the store", 5)

    rs.kill()
    rs.start()  # empty: no persistence
    await asyncio.sleep(3 * 0.5)  # three heartbeats
    assert await _replica_leases([p]) == held  # no admitted session forgotten
    await until(lambda: _store_leases(rs.url, pool), lambda got: got == held,
                "leases written back", 5)
    for s in holders:
        assert (await call(p.http, p.url, s, final=True)).status == 200
    empty: dict[str, set[str]] = {w: set() for w in WORKERS}
    await until(lambda: _store_leases(rs.url, pool), lambda got: got == empty,
                "every lease released", 3)
