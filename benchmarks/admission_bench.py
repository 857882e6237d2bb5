"""Admission state store benchmark (prints numbers; not a test).

    .venv/bin/python benchmarks/admission_bench.py [--redis-url URL] [--duration 3]

1. admit+release pairs per second per replica against a real Redis, with 1 and 2 replicas
   (one process each, like gateway replicas), at asyncio concurrency 32, and the latency of
   one pair and of one op (p50/p99) — also at concurrency 1, the loopback floor;
2. heartbeat cost (``renew``) with 10 000 leases held, Redis and memory;
3. memory per tracked session in the in-memory store (tracemalloc, 10 000 sessions).

Goals (issue 4): >= 5 000 admit+release/s per replica, p99 < 2 ms on loopback, < 10 KiB per
session.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
import tracemalloc
import uuid
from dataclasses import dataclass

import redis

from marsproxy.aimd.stores import MemoryStore, RedisStore, StoreConfig, wall_clock_ms

RECORD = {  # a typical session record: what the gateway keeps per session
    "worker": "http://10.0.0.7:8000",
    "context_tokens": 23_512,
    "attained_service_s": 41.7,
    "tool_estimates": {"bash": 2.1, "pytest": 11.4, "grep": 0.3},
    "turns": 17,
}


@dataclass
class Result:
    pairs: int
    seconds: float
    pair_lat_ms: list[float]
    op_lat_ms: list[float]


def _quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=1000, method="inclusive")[round(q * 1000) - 1]


def _pure_python(store: RedisStore) -> None:
    """Undo hiredis on ``store``'s client (parser and packer): the baseline of the A/B."""
    from redis._parsers import _AsyncRESP2Parser
    from redis.asyncio.connection import Connection

    pool = store.redis.connection_pool
    pool.connection_class = Connection
    pool.connection_kwargs["parser_class"] = _AsyncRESP2Parser


async def _drive(
    url: str, pool: str, concurrency: int, duration: float, hiredis: bool = True
) -> Result:
    cfg = StoreConfig(backend="redis", redis_url=url, pool=pool)
    store = RedisStore(cfg)
    if not hiredis:
        _pure_python(store)
    await store.start()
    pair_lat: list[float] = []
    op_lat: list[float] = []
    pairs = 0
    worker_names = [f"w{i}" for i in range(4)]
    stop = time.perf_counter() + duration

    async def client(n: int) -> None:
        nonlocal pairs
        i = 0
        while time.perf_counter() < stop:
            w, session = worker_names[i % 4], f"{store.replica_id}-{n}-{i}"
            i += 1
            t0 = time.perf_counter()
            ok = await store.try_admit(w, session, 1_000_000, wall_clock_ms())
            t1 = time.perf_counter()
            await store.release(w, session)
            t2 = time.perf_counter()
            assert ok
            pairs += 1
            pair_lat.append((t2 - t0) * 1e3)
            op_lat.extend(((t1 - t0) * 1e3, (t2 - t1) * 1e3))

    start = time.perf_counter()
    await asyncio.gather(*(client(n) for n in range(concurrency)))
    elapsed = time.perf_counter() - start
    assert store.failures_total == 0
    await store.close()
    return Result(pairs, elapsed, pair_lat, op_lat)


def _replica_main(url: str, pool: str, conc: int, dur: float, start_at: float, q: mp.Queue) -> None:  # type: ignore[type-arg]
    time.sleep(max(0.0, start_at - time.time()))  # replicas start together
    q.put(asyncio.run(_drive(url, pool, conc, dur)))


def bench_throughput(url: str, replicas: int, concurrency: int, duration: float) -> None:
    pool = f"bench-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    start_at = time.time() + 1.0  # spawn imports take a while
    procs = [
        ctx.Process(target=_replica_main, args=(url, pool, concurrency, duration, start_at, q))
        for _ in range(replicas)
    ]
    for p in procs:
        p.start()
    # A replica that crashed sends nothing: do not wait forever for it.
    results: list[Result] = [q.get(timeout=duration + 60) for _ in procs]
    for p in procs:
        p.join()
    _cleanup(url, pool)
    for i, r in enumerate(results):
        print(
            f"  redis  replicas={replicas} conc={concurrency:<3} replica {i}: "
            f"{r.pairs / r.seconds:8.0f} admit+release/s   "
            f"pair p50 {_quantile(r.pair_lat_ms, 0.5):.3f} ms p99 "
            f"{_quantile(r.pair_lat_ms, 0.99):.3f} ms   "
            f"op p50 {_quantile(r.op_lat_ms, 0.5):.3f} ms p99 {_quantile(r.op_lat_ms, 0.99):.3f} ms"
        )


def bench_client_ab(url: str, rounds: int, duration: float) -> None:
    """hiredis (reply parser + command packer) against pure-Python redis-py, interleaved
    rounds in one process so that machine noise hits both alike; medians and their ratio."""
    from marsproxy.aimd.stores.redis_pack import HIREDIS

    if not HIREDIS:
        print("  hiredis not installed: no A/B")
        return
    rates: dict[bool, list[float]] = {True: [], False: []}
    p99: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for fast in (False, True):
            pool = f"bench-{uuid.uuid4().hex[:8]}"
            r = asyncio.run(_drive(url, pool, 32, duration, hiredis=fast))
            _cleanup(url, pool)
            rates[fast].append(r.pairs / r.seconds)
            p99[fast].append(_quantile(r.op_lat_ms, 0.99))
    for fast, name in ((False, "pure-Python redis-py"), (True, "hiredis parse+pack")):
        print(f"  {name:<22} conc=32: median {statistics.median(rates[fast]):8.0f} pairs/s"
              f" (rounds {', '.join(f'{x:.0f}' for x in rates[fast])}),"
              f" op p99 median {statistics.median(p99[fast]):.2f} ms")
    ratio = statistics.median(rates[True]) / statistics.median(rates[False])
    print(f"  ratio hiredis / pure-Python: {ratio:.2f}x")


def _cleanup(url: str, pool: str) -> None:
    r = redis.Redis.from_url(url)
    keys = list(r.scan_iter(f"mars:{{{pool}}}:*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()


async def bench_heartbeat(url: str, sessions: int) -> None:
    pool = f"bench-{uuid.uuid4().hex[:8]}"
    for backend in ("redis", "memory"):
        cfg = StoreConfig(backend=backend, redis_url=url, pool=pool)
        store: RedisStore | MemoryStore
        store = RedisStore(cfg) if backend == "redis" else MemoryStore(cfg)
        now = wall_clock_ms()
        for i in range(sessions):
            await store.try_admit(f"w{i % 4}", f"s{i}", 1_000_000, now)
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            renewed = await store.renew(wall_clock_ms())
            times.append((time.perf_counter() - t0) * 1e3)
        assert renewed == sessions
        print(
            f"  {backend:<6} heartbeat renew of {sessions} leases: "
            f"median {statistics.median(times):.1f} ms, max {max(times):.1f} ms"
        )
        if isinstance(store, RedisStore):
            await store.link.close()
    _cleanup(url, pool)


async def bench_memory(sessions: int) -> None:
    cfg = StoreConfig()
    now = wall_clock_ms()
    for label, with_record in (("lease only", False), ("lease + session record", True)):
        tracemalloc.start()
        store = MemoryStore(cfg)
        base = tracemalloc.get_traced_memory()[0]
        for i in range(sessions):
            session = f"tenant-3f9a:session-{uuid.UUID(int=i)}"
            await store.try_admit(f"w{i % 4}", session, 1_000_000, now)
            if with_record:
                await store.save_session(session, RECORD)
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        print(
            f"  memory store, {sessions} sessions, {label}: {used / sessions:.0f} B/session "
            f"({used / 2**20:.1f} MiB total)"
        )
        del store


def bench_core(sessions: int) -> None:
    """Control-tick cost and memory of the pure admission core with ``sessions`` tracked.

    Four workers with roomy windows; sessions arrive until ``sessions`` are tracked (admitted
    up to the limits, the rest waiting), then ticks run under KV pressure that alternates
    between overload and calm so that the controllers and the queue do real work.
    """
    from marsproxy.aimd.admission import AdmissionCore, WorkerSignals
    from marsproxy.aimd.config import AdmissionConfig

    cfg = AdmissionConfig(window_init=200, window_max=200, queue_max=sessions * 2)
    workers = [f"w{i}" for i in range(4)]
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    core = AdmissionCore(cfg, workers)
    calm = {w: WorkerSignals(kv_usage=0.5, free_blocks=40_000, total_blocks=43_000,
                             block_size=16, tool_cpus=64.0) for w in workers}
    core.tick(0.0, calm)
    for i in range(sessions):
        core.on_request(0.001 * i, f"t/id/s{i}", "t", 2_000 + (i * 7919) % 30_000)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    hot = {w: WorkerSignals(kv_usage=0.95, free_blocks=2_000, total_blocks=43_000,
                            block_size=16, tool_cpus=64.0) for w in workers}
    now = sessions * 0.001
    times = []
    for k in range(200):
        now += cfg.control_interval_s
        t0 = time.perf_counter()
        core.tick(now, hot if k % 20 < 10 else calm)
        times.append(time.perf_counter() - t0)
    times.sort()
    print(
        f"  admission core, {sessions} tracked sessions: tick p50 "
        f"{1000 * times[len(times) // 2]:.2f} ms, p99 {1000 * times[int(0.99 * len(times))]:.2f}"
        f" ms (goal < 2 ms); memory {used / sessions:.0f} B/session (goal < 10 KiB)"
    )


def _calibrate() -> float:
    """Seconds for sum(range(30M)): ~0.5 s on a current server core, to compare machines."""
    t0 = time.perf_counter()
    sum(range(30_000_000))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per throughput run")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--sessions", type=int, default=10_000)
    args = ap.parse_args()
    redis.Redis.from_url(args.redis_url, socket_connect_timeout=1).ping()
    print(f"cpu calibration: sum(range(30M)) = {_calibrate():.2f} s, {mp.cpu_count()} CPUs")

    print("client A/B, 1 replica (pairs/s; interleaved rounds of the same load)")
    bench_client_ab(args.redis_url, 3, min(args.duration, 2.0))
    print("admit+release against Redis (latency includes client-side queueing at the event loop)")
    for replicas in (1, 2):
        bench_throughput(args.redis_url, replicas, args.concurrency, args.duration)
    bench_throughput(args.redis_url, 1, 1, args.duration)
    print("heartbeat")
    asyncio.run(bench_heartbeat(args.redis_url, args.sessions))
    print("memory")
    asyncio.run(bench_memory(args.sessions))
    print("control tick")
    bench_core(args.sessions)


if __name__ == "__main__":
    main()
