"""Two `marsproxy serve` replicas sharing one Redis behave as one admission plane.

Subprocesses on real sockets: two `marsproxy emulate` workers, two replicas with
``store.backend: redis`` and a pinned window of 2 sessions per worker (4 in all), a pool of
their own on the shared Redis (deleted afterwards). The Redis lease ZSETs are polled while the
load runs. Skipped only when no Redis answers on 127.0.0.1:6379. Waits are bounded polls.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from marsproxy.bench.procs import CLI as PROC_CLI
from marsproxy.bench.procs import free_port, wait_up

CLI = list(PROC_CLI)
REDIS_URL = "redis://127.0.0.1:6379/0"
WINDOW = 2  # per worker
WORKERS = ("w0", "w1")
LIMIT = WINDOW * len(WORKERS)
LEASE_TTL_S = 2.0








@dataclass
class Cluster:
    replicas: list[str]
    procs: list[subprocess.Popen[bytes]]
    pool: str
    redis: redis.Redis

    def held(self) -> dict[str, int]:
        """Live leases per worker in Redis: all replicas together."""
        now_ms = time.time_ns() // 1_000_000
        return {
            w: int(self.redis.zcount(f"mars:{{{self.pool}}}:adm:{w}", f"({now_ms}", "+inf"))
            for w in WORKERS
        }


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    r = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1)
    try:
        r.ping()
    except Exception as exc:  # .ci/run starts Redis; a bare `pytest` elsewhere may have none
        r.close()
        pytest.skip(f"no Redis on 127.0.0.1:6379 ({exc!r})")
    pool = f"e2e-{uuid.uuid4().hex[:12]}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls = []
        for _ in WORKERS:
            port = free_port()
            procs.append(subprocess.Popen(
                [*CLI, "emulate", "--profile", "tiny", "--port", str(port), "--time-scale", "0.05"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
            urls.append(f"http://127.0.0.1:{port}")
            wait_up(f"{urls[-1]}/health", procs[-1])
        cfg = tmp_path / "marsproxy.yaml"
        named = zip(urls, WORKERS, strict=True)
        cfg.write_text(
            "workers:\n"
            + "".join(f"  - {{url: '{u}', name: {n}}}\n" for u, n in named)
            + "health: {interval_s: 0.2}\n"
            + "probes: {vllm: {period_s: 0.1, stale_after_s: 1.0}, nvml: {enabled: false}}\n"
            + f"admission: {{window_init: {WINDOW}, window_min: {WINDOW}, window_max: {WINDOW},"
            + " control_interval_s: 0.1}\n"
            + f"store: {{backend: redis, redis_url: '{REDIS_URL}', pool: {pool},"
            + f" lease_ttl_s: {LEASE_TTL_S}, heartbeat_interval_s: 0.5, leader_ttl_s: 1.0}}\n"
        )
        replicas = []
        for _ in range(2):
            port = free_port()
            procs.append(subprocess.Popen(
                [*CLI, "serve", "--config", str(cfg), "--port", str(port)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
            replicas.append(f"http://127.0.0.1:{port}")
            wait_up(f"{replicas[-1]}/readyz", procs[-1])
        yield Cluster(replicas, procs, pool, r)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        keys = list(r.scan_iter(f"mars:{{{pool}}}:*", count=1000))
        if keys:
            r.delete(*keys)
        r.close()


async def _chat(http: aiohttp.ClientSession, base: str, session: str, final: bool) -> int:
    headers = {"x-session-id": session}
    if final:
        headers["x-session-final"] = "true"
    body = {"model": "tiny-emulated", "max_tokens": 4,
            "messages": [{"role": "user", "content": f"hello from {session}"}]}
    async with http.post(f"{base}/v1/chat/completions", json=body, headers=headers) as r:
        await r.read()
        return r.status


async def _agent(http: aiohttp.ClientSession, base: str, session: str, turns: int) -> list[int]:
    out = []
    for t in range(turns):
        out.append(await _chat(http, base, session, final=t == turns - 1))
        await asyncio.sleep(0.05)  # its "tool"
    return out


async def test_replicas_never_exceed_the_limit_together(cluster: Cluster) -> None:
    max_seen: dict[str, int] = dict.fromkeys(WORKERS, 0)
    total_seen = 0
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        agents = [
            asyncio.create_task(_agent(http, cluster.replicas[i % 2], f"load-{i}", 3))
            for i in range(12)
        ]
        while not all(a.done() for a in agents):
            held = await asyncio.to_thread(cluster.held)
            total_seen = max(total_seen, sum(held.values()))
            for w, n in held.items():
                max_seen[w] = max(max_seen[w], n)
            await asyncio.sleep(0.01)
        results = [a.result() for a in agents]
    assert all(statuses == [200, 200, 200] for statuses in results), results
    assert total_seen == LIMIT  # the load filled the window ...
    assert total_seen <= LIMIT and all(n <= WINDOW for n in max_seen.values())  # ... never more
    assert await asyncio.to_thread(cluster.held) == dict.fromkeys(WORKERS, 0)


async def test_killed_replica_slots_come_back_within_a_lease_ttl(cluster: Cluster) -> None:
    a, b = cluster.replicas
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for i in range(LIMIT):  # replica A takes every slot and keeps them (no final turn)
            assert await _chat(http, a, f"holder-{i}", final=False) == 200
        assert sum((await asyncio.to_thread(cluster.held)).values()) == LIMIT
        newcomer = asyncio.create_task(_chat(http, b, "newcomer", final=True))
        await asyncio.sleep(LEASE_TTL_S / 2)
        assert not newcomer.done()  # B waits: the window is full of A's sessions
        cluster.procs[2].send_signal(signal.SIGKILL)  # replica A dies holding them
        cluster.procs[2].wait(timeout=10)
        # Its leases expire within one TTL; B's next admission pass takes a slot.
        assert await asyncio.wait_for(newcomer, LEASE_TTL_S * 5) == 200
        async with http.get(f"{b}/mars/v1/state") as r:
            state: dict[str, Any] = await r.json()
    assert state["admission"]["store"]["backend"] == "redis"
    assert state["admission"]["store"]["up"] is True
