"""`marsproxy serve` replicas sharing one Redis behave as one admission plane.

Subprocesses on real sockets: two `marsproxy emulate` workers, two or three replicas with
``store.backend: redis`` and a pinned window of 2 sessions per worker (4 in all), and a
redis-server of the test's own on a free port (never the shared one; tests kill it). The
Redis lease ZSETs are read directly while the load runs. Waits are bounded polls.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from marsproxy.bench.procs import CLI, RedisServer, free_port, stop_all, wait_up

WINDOW = 2  # per worker
WORKERS = ("w0", "w1")
LIMIT = WINDOW * len(WORKERS)
LEASE_TTL_S = 2.0
HEARTBEAT_S = 0.3
POOL = "e2e"

pytestmark = pytest.mark.skipif(not RedisServer.available(), reason="redis-server not installed")


@dataclass
class Cluster:
    replicas: list[str]
    procs: list[subprocess.Popen[bytes]]  # replicas only
    workers: dict[str, str]  # label → url
    server: RedisServer
    http: aiohttp.ClientSession
    redis: redis.Redis

    def key(self, suffix: str) -> str:
        return f"mars:{{{POOL}}}:{suffix}"

    def held(self) -> dict[str, list[str]]:
        """Sessions with a live lease per worker in Redis: all replicas together."""
        now_ms = time.time_ns() // 1_000_000
        return {
            w: sorted(s.decode().split("/id/")[-1] for s in self.redis.zrangebyscore(
                self.key(f"adm:{w}"), f"({now_ms}", "+inf"))
            for w in WORKERS
        }

    def total(self) -> int:
        return sum(len(v) for v in self.held().values())

    def owner(self, worker: str, session: str) -> str | None:
        got = self.redis.hget(self.key(f"own:{worker}"), f"anon/id/{session}")
        return None if got is None else got.decode()

    async def chat(self, base: str, session: str, *, final: bool = False,
                   turn: int = 0) -> int:
        headers = {"x-session-id": session}
        if final:
            headers["x-session-final"] = "true"
        body = {"model": "tiny-emulated", "max_tokens": 4,
                "messages": [{"role": "user", "content": f"turn {turn} of {session}"}]}
        async with self.http.post(f"{base}/v1/chat/completions", json=body,
                                  headers=headers) as r:
            await r.read()
            return r.status

    async def state(self, base: str) -> dict[str, Any]:
        async with self.http.get(f"{base}/mars/v1/state") as r:
            return await r.json()  # type: ignore[no-any-return]

    async def served(self, label: str) -> float:
        """Requests the worker has finished (its own /metrics)."""
        async with self.http.get(f"{self.workers[label]}/metrics") as r:
            text = await r.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total"))

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(timeout=10)


def _popen(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def until(cond: Callable[[], Awaitable[bool] | bool], within: float) -> float:
    start = time.monotonic()
    while True:
        got = cond()
        if not isinstance(got, bool):
            got = await got
        if got:
            return time.monotonic() - start
        if time.monotonic() - start > within:
            raise AssertionError(f"condition not met within {within} s")
        await asyncio.sleep(0.05)


MakeCluster = Callable[..., Awaitable[Cluster]]


@pytest.fixture(scope="module")
def emulators() -> Iterator[dict[str, str]]:
    """Two emulated workers for every test of the module (their state does not matter)."""
    procs: list[subprocess.Popen[bytes]] = []
    workers: dict[str, str] = {}
    try:
        for w in WORKERS:
            port = free_port()
            procs.append(_popen([*CLI, "emulate", "--profile", "tiny", "--port", str(port),
                                 "--time-scale", "0.05"]))
            workers[w] = f"http://127.0.0.1:{port}"
        for w, p in zip(WORKERS, procs, strict=True):
            wait_up(f"{workers[w]}/health", p)
        yield workers
    finally:
        stop_all(procs)


@pytest.fixture
async def make_cluster(
    tmp_path: Path, emulators: dict[str, str]
) -> AsyncIterator[MakeCluster]:
    made: list[Cluster] = []

    async def make(replicas: int = 2, **store: Any) -> Cluster:
        server = RedisServer(str(tmp_path))
        server.start()
        procs: list[subprocess.Popen[bytes]] = []
        http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        c = Cluster([], procs, emulators, server, http, redis.Redis.from_url(server.url))
        made.append(c)
        opts = {"lease_ttl_s": LEASE_TTL_S, "heartbeat_interval_s": HEARTBEAT_S,
                "leader_ttl_s": 1.0, "reconnect_interval_s": 0.2} | store
        cfg = tmp_path / "marsproxy.yaml"
        cfg.write_text(
            "workers:\n"
            + "".join(f"  - {{url: '{u}', name: {n}}}\n" for n, u in emulators.items())
            + "health: {interval_s: 0.2}\n"
            + "probes: {vllm: {period_s: 0.1, idle_period_s: 0.1, stale_after_s: 1.0},"
            + " nvml: {enabled: false}}\n"
            + f"admission: {{window_init: {WINDOW}, window_min: {WINDOW}, window_max: {WINDOW},"
            + " tuning: {control_interval_s: 0.1}}\n"
            + f"store: {{backend: redis, redis_url: '{server.url}', pool: {POOL}, "
            + ", ".join(f"{k}: {v}" for k, v in opts.items()) + "}\n"
        )
        for _ in range(replicas):
            port = free_port()
            procs.append(_popen([*CLI, "serve", "--config", str(cfg), "--port", str(port)]))
            c.replicas.append(f"http://127.0.0.1:{port}")
        for url, p in zip(c.replicas, procs, strict=True):
            await asyncio.to_thread(wait_up, f"{url}/readyz", p)
        return c

    yield make
    for c in made:
        stop_all(c.procs)
        await c.http.close()
        c.redis.close()
        c.server.kill()


async def test_replicas_never_exceed_the_limit_together(make_cluster: MakeCluster) -> None:
    c = await make_cluster(replicas=3)
    peak: dict[str, int] = dict.fromkeys(WORKERS, 0)
    total_peak = 0

    async def agent(i: int) -> list[int]:
        base = c.replicas[i % 3]
        out = []
        for t in range(3):
            out.append(await c.chat(base, f"load-{i}", final=t == 2, turn=t))
            await asyncio.sleep(0.05)  # its "tool"
        return out

    agents = [asyncio.create_task(agent(i)) for i in range(12)]
    while not all(a.done() for a in agents):
        held = await asyncio.to_thread(c.held)
        total_peak = max(total_peak, sum(len(v) for v in held.values()))
        for w, ss in held.items():
            peak[w] = max(peak[w], len(ss))
        await asyncio.sleep(0.01)
    results = [a.result() for a in agents]
    assert all(statuses == [200, 200, 200] for statuses in results), results
    # Redis answered every op in time (op_timeout_s): the shared count was the only count.
    # (A slow op counts as an outage, and on_store_failure: local admits a share per replica.)
    failures = [(await c.state(u))["admission"]["store"]["failures_total"] for u in c.replicas]
    assert failures == [0, 0, 0], failures
    assert total_peak == LIMIT  # the load filled the window ...
    assert all(n <= WINDOW for n in peak.values()), peak  # ... never more, on any worker
    assert await asyncio.to_thread(c.total) == 0  # every final turn released its slot


async def test_killed_replica_slots_come_back_within_a_lease_ttl(
    make_cluster: MakeCluster,
) -> None:
    c = await make_cluster()
    a, b = c.replicas
    for i in range(LIMIT):  # replica A takes every slot and keeps them (no final turn)
        assert await c.chat(a, f"holder-{i}") == 200
    assert await asyncio.to_thread(c.total) == LIMIT
    newcomer = asyncio.create_task(c.chat(b, "newcomer", final=True))
    await asyncio.sleep(LEASE_TTL_S / 2)
    assert not newcomer.done()  # B waits: the window is full of A's sessions
    c.kill(0)  # replica A dies holding them
    killed = time.monotonic()
    assert await asyncio.wait_for(newcomer, LEASE_TTL_S * 5) == 200
    # Its leases expired within one TTL (plus B's next admission pass), not later.
    assert time.monotonic() - killed < LEASE_TTL_S + 1.5
    st = (await c.state(b))["admission"]["store"]
    assert st["backend"] == "redis" and st["up"] is True


async def test_the_leader_dies_and_another_replica_publishes_the_windows(
    make_cluster: MakeCluster,
) -> None:
    c = await make_cluster(replicas=3)

    async def leaders() -> list[int]:
        states = [await c.state(u) for i, u in enumerate(c.replicas) if c.procs[i].poll() is None]
        alive = [i for i, p in enumerate(c.procs) if p.poll() is None]
        return [i for i, s in zip(alive, states, strict=True)
                if s["admission"]["store"]["is_leader"]]

    async def one_leader() -> bool:
        return len(await leaders()) == 1

    await until(one_leader, 10)
    dead = (await leaders())[0]

    def published_ms() -> int:
        raw = c.redis.hget(c.key("windows"), "w0")
        return 0 if raw is None else int(__import__("json").loads(raw)["updated_ms"])

    c.kill(dead)
    killed_ms = time.time_ns() // 1_000_000
    # Another replica takes the leader key after its TTL (1 s) and publishes again.
    await until(lambda: published_ms() > killed_ms, 5)
    await until(one_leader, 5)
    assert dead not in await leaders()


async def test_a_session_continues_on_another_replica_without_a_new_admission(
    make_cluster: MakeCluster,
) -> None:
    c = await make_cluster()
    a, b = c.replicas
    assert await c.chat(a, "roam", turn=0) == 200
    for i in range(LIMIT - 1):  # the window is full now, all of it held by A
        assert await c.chat(a, f"holder-{i}") == 200
    held = await asyncio.to_thread(c.held)
    (worker,) = [w for w, ss in held.items() if "roam" in ss]
    a_id = c.owner(worker, "roam")
    before = await c.served(worker)
    # Turn 2 lands on B, which never saw it: served at once (a new admission would wait for
    # a slot), on the same worker, under the same lease, now B's.
    assert await asyncio.wait_for(c.chat(b, "roam", turn=1), 10) == 200
    assert await c.served(worker) == before + 1
    assert await asyncio.to_thread(c.held) == held
    assert c.owner(worker, "roam") not in (None, a_id)
    b_state = await c.state(b)
    assert "roam" in b_state["admission"]["workers"][worker]["sessions"]

    async def a_forgot() -> bool:
        return "roam" not in (await c.state(a))["admission"]["workers"][worker]["sessions"]

    await until(a_forgot, 5 * HEARTBEAT_S + 2)  # A's heartbeat finds the lease moved
    # Many lease TTLs later the lease is alive (B renews it; A does not resurrect anything).
    await asyncio.sleep(LEASE_TTL_S * 1.5)
    assert "roam" in (await asyncio.to_thread(c.held))[worker]
    # Its final turn on A again: A adopts it back, serves it, and the slot is freed once.
    assert await asyncio.wait_for(c.chat(a, "roam", final=True, turn=2), 10) == 200
    assert await c.served(worker) == before + 2
    await until(lambda: c.total() == LIMIT - 1, 3)  # released just after the response
    assert c.redis.get(c.key("sess:anon/id/roam")) is None  # its record is gone too
    newcomer = asyncio.create_task(c.chat(b, "newcomer", final=True))
    assert await asyncio.wait_for(newcomer, 10) == 200  # the freed slot serves the next one


async def test_delete_on_a_replica_that_does_not_hold_the_session(
    make_cluster: MakeCluster,
) -> None:
    c = await make_cluster()
    a, b = c.replicas
    for i in range(LIMIT):
        assert await c.chat(a, f"holder-{i}") == 200
    async with c.http.delete(f"{b}/mars/v1/sessions/holder-0") as r:
        assert r.status == 200 and (await r.json())["ended"] is True
    async with c.http.delete(f"{b}/mars/v1/sessions/holder-0") as r:
        assert r.status == 404  # ended once; nothing left to end
    await until(lambda: c.total() == LIMIT - 1, 3)

    async def a_dropped() -> bool:
        workers = (await c.state(a))["admission"]["workers"]
        return sum(w["admitted"] for w in workers.values()) == LIMIT - 1

    await until(a_dropped, 5 * HEARTBEAT_S + 2)
    await asyncio.sleep(LEASE_TTL_S * 1.5)  # A's renewals never bring it back
    assert await asyncio.to_thread(c.total) == LIMIT - 1
    # The freed slot is usable from either replica.
    assert await asyncio.wait_for(c.chat(b, "newcomer", final=True), 10) == 200


@pytest.mark.parametrize("mode", ["local", "closed", "open"])
async def test_redis_restarted_mid_run(make_cluster: MakeCluster, mode: str) -> None:
    """While Redis is away each mode behaves as docs/admission.md says; after it is back
    (empty: no persistence) Redis holds every admitted session exactly once."""
    c = await make_cluster(on_store_failure=mode, op_timeout_s=0.2)
    a, b = c.replicas
    assert await c.chat(a, "holder-a") == 200
    assert await c.chat(b, "holder-b") == 200

    async def see_each_other() -> bool:  # local mode divides by the replicas last seen
        seen = [(await c.state(u))["admission"]["store"]["live_replicas"] for u in c.replicas]
        return seen == [2, 2]

    await until(see_each_other, 5)
    c.server.kill()

    async def both_down() -> bool:
        for u in c.replicas:
            st = (await c.state(u))["admission"]["store"]
            if st["up"] or st["mode"] != mode:
                return False
        return True

    await until(both_down, 10)
    news = {f"new-{r}{i}": asyncio.create_task(c.chat(base, f"new-{r}{i}"))
            for r, base in (("a", a), ("b", b)) for i in range(3)}
    done, _ = await asyncio.wait(news.values(), timeout=3)
    statuses = {s: t.result() for s, t in news.items() if t in done}
    if mode == "closed":  # nothing new: 503 at once
        assert sorted(statuses.values()) == [503] * 6
    elif mode == "local":  # each replica's share: the limit (2 per worker) // 2 replicas
        assert sorted(statuses.values()) == [200] * 2
    else:  # open: each replica's own windows, so together up to 2 x the limit
        assert sorted(statuses.values()) == [200] * 6
    assert await c.chat(a, "holder-a", turn=1) == 200  # continuations go on
    for t in news.values():
        t.cancel()  # waiting clients give up: their sessions leave the queues
    c.server.start()  # same port, empty
    admitted = {"holder-a", "holder-b"} | {s for s, st in statuses.items() if st == 200}

    def resynced() -> bool:
        got = c.held()
        return sorted(s for ss in got.values() for s in ss) == sorted(admitted)

    await until(resynced, 10)  # nothing lost, nothing twice (a ZSET member is unique)

    async def counted() -> bool:  # each replica counts them from the store again
        for u in c.replicas:
            st = (await c.state(u))["admission"]
            n = sum(w["admitted_store"] for w in st["workers"].values())
            if not st["store"]["up"] or n != len(admitted):
                return False
        return True

    await until(counted, 5)
