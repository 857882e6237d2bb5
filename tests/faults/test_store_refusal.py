"""A Redis that answers but refuses the proxy is an outage, not a crash.

Two refusals an operator meets: a read-only replica (a failover promoted another node, or the
URL names a replica: every write says ``READONLY``), and protected mode (a Redis without a
password refuses clients that are not on loopback: ``DENIED`` at connect). Documented outcome
(docs/reliability.md): the replica starts and serves as ``store.on_store_failure`` says, logs
what Redis said, and moves its sessions into the store once Redis accepts it again.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import psutil
import pytest
import redis

from marsproxy.bench.procs import RedisServer, free_port
from marsproxy.gateway.shells.sessions import unscoped_id
from tests.faults.conftest import Lab, Proxy, call, redis_leases, until

pytestmark = pytest.mark.timeout(60)

STORE = {"lease_ttl_s": 2.0, "heartbeat_interval_s": 0.5, "leader_ttl_s": 1.0,
         "op_timeout_s": 0.3, "reconnect_interval_s": 0.2}


async def _store(p: Proxy) -> dict[str, object]:
    return dict((await p.state())["admission"]["store"])


def _ids(leases: dict[str, dict[str, str]]) -> set[str]:
    return {unscoped_id(s) for s in leases["w0"]}


def _non_loopback_ipv4() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return str(a.address)
    return None


async def test_read_only_replica_degrades_then_recovers_on_promotion(lab: Lab) -> None:
    # A replica of a master that is not there: reads work, every write says READONLY.
    rs = lab.redis(extra=("--replicaof", "127.0.0.1", str(free_port())))
    w = lab.emulator("w0")
    cfg = lab.config({"w0": w}, {"store": {"backend": "redis", "redis_url": rs.url,
                                           "pool": "readonly", "on_store_failure": "local",
                                           **STORE}})
    p = lab.proxy(cfg)
    # local mode: the session is served although the store cannot take its lease.
    assert (await call(p.http, p.url, "s1")).status == 200
    st = await until(lambda: _store(p), lambda s: not s["up"], "outage noticed", 5)
    assert int(str(st["failures_total"])) >= 1
    assert "ReadOnlyError" in p.svc.log_tail(200), p.svc.log_tail(200)

    # Promotion (what a failover does): the replica takes writes, the proxy writes its view back.
    await asyncio.to_thread(_redis_cmd, rs.url, "REPLICAOF", "NO", "ONE")
    await until(lambda: _store(p), lambda s: bool(s["up"]), "recovery noticed", 5)
    await until(lambda: asyncio.to_thread(redis_leases, rs.url, "readonly", ["w0"]),
                lambda got: _ids(got) == {"s1"}, "s1's lease written back", 5)
    assert (await call(p.http, p.url, "s1", final=True)).status == 200
    await until(lambda: asyncio.to_thread(redis_leases, rs.url, "readonly", ["w0"]),
                lambda got: _ids(got) == set(), "lease released", 5)


def _protected_redis(lab: Lab) -> RedisServer:
    """A Redis in protected mode on a non-loopback address: it refuses the proxy. It listens
    on loopback too, so the test (as an operator would) can turn protected mode off."""
    ip = _non_loopback_ipv4()
    if ip is None:
        pytest.skip("no non-loopback IPv4 address: protected mode cannot refuse anyone")
    return lab.redis(host=ip, extra=("--bind", f"{ip} 127.0.0.1", "--protected-mode", "yes"))


async def test_protected_mode_refusal_degrades_then_recovers(lab: Lab) -> None:
    rs = _protected_redis(lab)
    w = lab.emulator("w0")
    cfg = lab.config({"w0": w}, {"store": {"backend": "redis", "redis_url": rs.url,
                                           "pool": "denied", "on_store_failure": "closed",
                                           **STORE}})
    p = lab.proxy(cfg)  # starts: it used to die on the DENIED reply
    r = await call(p.http, p.url, "s1")
    assert r.status == 503 and r.json()["error"]["code"] == "store_unavailable", r
    assert not (await _store(p))["up"]
    assert "DENIED Redis is running in protected mode" in p.svc.log_tail(200)

    local = f"redis://127.0.0.1:{rs.port}/0"
    await asyncio.to_thread(_redis_cmd, local, "CONFIG", "SET", "protected-mode", "no")
    await until(lambda: _store(p), lambda s: bool(s["up"]), "recovery noticed", 5)
    assert (await call(p.http, p.url, "s2")).status == 200
    got = await asyncio.to_thread(redis_leases, local, "denied", ["w0"])
    assert _ids(got) == {"s2"}, got


def _redis_cmd(url: str, *args: str) -> None:
    r = redis.Redis.from_url(url, socket_timeout=5)
    try:
        r.execute_command(*args)
    finally:
        r.close()


async def test_wakeup_subscription_comes_back_after_a_refusal(lab: Lab) -> None:
    """The wake-up subscription met the same refusal (DENIED at connect) as the data ops; once
    Redis accepts the proxy it subscribes again (other replicas' releases wake its waiters):
    it used to end for good on that reply."""
    rs = _protected_redis(lab)
    w = lab.emulator("w0")
    cfg = lab.config({"w0": w}, {"store": {"backend": "redis", "redis_url": rs.url,
                                           "pool": "denied-sub", **STORE}})
    p = lab.proxy(cfg)
    await until(lambda: _store(p), lambda s: not s["up"], "outage noticed", 5)
    await asyncio.sleep(0.5)  # the subscription tries (and is refused) meanwhile
    local = f"redis://127.0.0.1:{rs.port}/0"
    await asyncio.to_thread(_redis_cmd, local, "CONFIG", "SET", "protected-mode", "no")
    await until(lambda: _store(p), lambda s: bool(s["up"]), "recovery noticed", 5)
    await until(lambda: asyncio.to_thread(_subscribers, local, "mars:{denied-sub}:wake"),
                lambda n: n == 1, "the wake-up subscription is back", 5)


def _subscribers(url: str, channel: str) -> int:
    r = redis.Redis.from_url(url, socket_timeout=5)
    try:
        return int(r.pubsub_numsub(channel)[0][1])
    finally:
        r.close()
