#!/usr/bin/env python3
"""Soak: many agent sessions through the demo setup; nothing lost, nothing leaked.

Two emulated workers (``marsproxy emulate``, tiny profile, sped up), one or more
``marsproxy serve`` replicas with admission on (optionally sharing a private redis-server),
and N sessions replayed from the packaged trace (as ``marsproxy demo`` does: streamed turns,
tool phases as waits, the last turn final), arriving at a steady rate over at least
``--duration-s``. The proxies' open fds, resident memory, event-loop tasks and requests in
flight are sampled all along. At the end it checks and prints:

- lost: every session completed, or its first request got a documented refusal
  (429 ``queue_full``, 503 ``queue_deadline`` / ``no_healthy_worker`` / ``store_unavailable``);
- leaked: admitted sessions, the admission queue and the session tables back to 0, no lease or
  queue entry left in Redis, no request left running in the workers, fds and tasks back at
  their warm-up level, resident memory flat after warm-up.

Exit status 0 when every check passes. Usage (docs/reliability.md has the recorded run):

    .venv/bin/python scripts/soak.py --sessions 10000 --duration-s 600 --redis --replicas 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import redis
import yaml

# What is measured and the report; a sibling module: this script's directory is on sys.path.
from soak_report import Sample, Tally, report

from marsproxy.bench.agent import ReplayOptions, SessionResult, replay_session
from marsproxy.bench.procs import RedisServer, Service
from marsproxy.runs.trace import SessionTrace, load_trace

DOCUMENTED_REFUSALS = {"queue_full", "queue_deadline", "no_healthy_worker", "store_unavailable"}
WORKERS = ("w0", "w1")
POOL = "soak"


def _config(
    args: argparse.Namespace, workers: list[Service], redis_url: str | None
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "workers": [{"url": w.url, "name": n} for w, n in zip(workers, WORKERS, strict=True)],
        "server": {"log_level": "warning"},
        "probes": {"nvml": {"enabled": False}, "cpu": {"tool_cpus": 64}},  # tools are sleeps
        "sessions": {"idle_ttl_s": args.idle_ttl_s},
        # A window smaller than the sessions in flight: the admission queue is exercised.
        "admission": {"queue_deadline_s": 120.0, "window_init": args.window,
                      "window_max": args.window, "window_min": min(4, args.window)},
    }
    if redis_url is not None:
        cfg["store"] = {"backend": "redis", "redis_url": redis_url, "pool": POOL}
    return cfg


async def _get_json(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url) as r:
        return await r.json()  # type: ignore[no-any-return]


async def _metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if re.match(rf"{re.escape(name)}[ {{]", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _sample(http: aiohttp.ClientSession, proxies: list[Service], t0: float) -> Sample:
    fds = rss = tasks = in_flight = admitted = queued = sessions = ledger = dispatch = 0
    for p in proxies:
        st = await _get_json(http, p.url + "/mars/v1/state")
        adm = st["admission"]
        fds += p.fds()
        rss += p.rss_bytes()
        tasks += int(await _metric(http, p.url, "marsproxy_event_loop_tasks"))
        in_flight += int(await _metric(http, p.url, "marsproxy_requests_in_flight"))
        admitted += sum(int(w["admitted"]) for w in adm["workers"].values())
        queued += int(adm["queue"]["length"]) + int(adm["queue"]["pending"])
        sessions += int(st["sessions"]["total"])
        for w in st["workers"]:
            ledger += int(w["scheduler"]["retained_blocks"])
            dispatch += int(w["scheduler"]["queue_length"])
    return Sample(time.monotonic() - t0, fds, rss, tasks, in_flight, admitted, queued, sessions,
                  ledger, dispatch)


def _classify(res: SessionResult, tally: Tally) -> None:
    tally.requests += len(res.turns)
    if res.ok:
        tally.completed += 1
        return
    bad = next(t for t in res.turns if not t.ok)
    code = ""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        code = json.loads(bad.error)["error"]["code"]
    first = res.turns.index(bad) == 0
    if first and code in DOCUMENTED_REFUSALS:
        tally.refused[f"{bad.status} {code}"] += 1
    else:  # an admitted session that failed, or an undocumented error: lost
        tally.lost.append(f"{res.session_id}: turn {res.turns.index(bad)} {bad.status} "
                          f"{bad.error[:120]}")


async def _run_sessions(
    args: argparse.Namespace, http: aiohttp.ClientSession, proxies: list[Service],
    traces: list[SessionTrace], tally: Tally,
) -> None:
    gap = args.duration_s / args.sessions
    gate = asyncio.Semaphore(args.concurrency)
    system = "You are a coding agent. " * 10
    t0 = time.monotonic()

    async def one(i: int) -> None:
        trace = dataclasses.replace(traces[i % len(traces)], id=f"soak-{i}")
        p = proxies[i % len(proxies)]
        opts = ReplayOptions(
            base_url=p.url, model="tiny-emulated", token_scale=args.token_scale,
            tool_time_scale=args.tool_time_scale, max_turns=args.max_turns,
            system_prompt_tokens=60, seed=i, request_timeout_s=180.0,
        )
        try:
            _classify(await replay_session(http, trace, opts, system), tally)
        finally:
            gate.release()

    tasks: list[asyncio.Task[None]] = []
    for i in range(args.sessions):
        delay = t0 + i * gap - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        await gate.acquire()  # at most --concurrency sessions at once
        tasks.append(asyncio.create_task(one(i)))
        if i and i % max(1, args.sessions // 20) == 0:
            print(f"  {i} sessions started, {tally.completed} completed, "
                  f"{sum(tally.refused.values())} refused, {len(tally.lost)} lost", flush=True)
    await asyncio.gather(*tasks)


async def _sampler(
    http: aiohttp.ClientSession, proxies: list[Service], every_s: float, out: list[Sample],
    t0: float,
) -> None:
    while True:
        out.append(await _sample(http, proxies, t0))
        await asyncio.sleep(every_s)


async def _stall_redis(url: str, args: argparse.Namespace) -> int:
    """Every so often Redis stops answering for a while (DEBUG SLEEP): ops time out, the
    replicas fall back to ``on_store_failure`` and resync when it answers again."""
    n = 0
    try:
        while True:
            await asyncio.sleep(args.redis_stall_every_s)
            await asyncio.to_thread(_debug_sleep, url, args.redis_stall_s)
            n += 1
    except asyncio.CancelledError:
        return n


def _debug_sleep(url: str, seconds: float) -> None:
    r = redis.Redis.from_url(url, socket_timeout=seconds + 10)
    try:
        r.execute_command("DEBUG", "SLEEP", str(seconds))  # type: ignore[no-untyped-call]
    finally:
        r.close()


async def _count(task: asyncio.Task[int]) -> int:
    try:
        return await task
    except asyncio.CancelledError:
        return -1


async def _redis_leftovers(url: str) -> tuple[dict[str, int], list[str]]:
    """Counts of what the pool still holds in Redis, and the first queue members left."""
    def scan() -> tuple[dict[str, int], list[str]]:
        r = redis.Redis.from_url(url, decode_responses=True)
        try:
            now_ms = time.time_ns() // 1_000_000
            base = f"mars:{{{POOL}}}:"
            return {
                "leases": sum(int(r.zcount(f"{base}adm:{w}", f"({now_ms}", "+inf"))
                              for w in WORKERS),
                "lease_entries": sum(int(r.zcard(f"{base}adm:{w}")) for w in WORKERS),
                "owner_entries": sum(int(r.hlen(f"{base}own:{w}")) for w in WORKERS),
                "queue": int(r.zcard(f"{base}queue")),
                "session_records": sum(1 for _ in r.scan_iter(f"{base}sess:*", count=1000)),
            }, [str(m) for m in r.zrange(f"{base}queue", 0, 9)]
        finally:
            r.close()

    return await asyncio.to_thread(scan)


async def soak(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="marsproxy-soak-"))
    services: list[Service] = []
    rs: RedisServer | None = None
    try:
        if args.redis:
            rs = RedisServer(tmp)
            rs.start()
        extra = ("--num-blocks", "8192", "--max-num-seqs", "256")
        workers = [Service.emulator(tmp, n, time_scale=args.time_scale, extra=extra).start()
                   for n in WORKERS]
        services += workers
        cfg_path = tmp / "marsproxy.yaml"
        cfg_path.write_text(yaml.safe_dump(_config(args, workers, rs.url if rs else None)))
        proxies = [Service.proxy(tmp, f"proxy{i}", cfg_path).start()
                   for i in range(args.replicas)]
        services += proxies
        print(f"soak: {args.sessions} sessions over >= {args.duration_s:.0f} s, "
              f"{args.replicas} replica(s), store {rs.url if rs else 'memory'}; logs in {tmp}")
        traces = load_trace(args.trace)
        tally = Tally()
        samples: list[Sample] = []
        # The probes use no keep-alive: their connections must not count as the proxies' own.
        probe_conn = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(
            connector=probe_conn, timeout=aiohttp.ClientTimeout(total=30)
        ) as http:
            t0 = time.monotonic()
            baseline = await _sample(http, proxies, t0)
            sampler = asyncio.create_task(_sampler(http, proxies, args.sample_every_s, samples,
                                                   t0))
            stalls = None
            if rs is not None and args.redis_stall_every_s > 0:
                stalls = asyncio.create_task(_stall_redis(rs.url, args))
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=300),
            ) as agents:
                await _run_sessions(args, agents, proxies, traces, tally)
            if stalls is not None:
                stalls.cancel()
                print(f"redis stalled {await _count(stalls)} times for {args.redis_stall_s} s")
            run_s = time.monotonic() - t0
            sampler.cancel()
            # Quiet: the tables forget ended sessions at once; refused ones after idle_ttl_s.
            deadline = time.monotonic() + args.idle_ttl_s + 15
            while True:
                end = await _sample(http, proxies, t0)
                if (end.sessions == 0 and end.admitted == 0 and end.in_flight == 0
                        and end.ledger_blocks == 0) or (
                    time.monotonic() > deadline
                ):
                    break
                await asyncio.sleep(0.5)
            upstream = sum([
                await _metric(http, w.url, g) for w in workers
                for g in ("vllm:num_requests_running", "vllm:num_requests_waiting")
            ])
            leftovers, queue_left = await _redis_leftovers(rs.url) if rs else ({}, [])
            if queue_left:
                print(f"redis queue still holds: {queue_left}")
        return report(args, tally, baseline, samples, end, upstream, leftovers, run_s)
    finally:
        for s in services:
            s.stop()
        if rs is not None:
            rs.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sessions", type=int, default=10_000)
    p.add_argument("--duration-s", type=float, default=600.0,
                   help="sessions arrive evenly over at least this long")
    p.add_argument("--concurrency", type=int, default=200, help="sessions in flight at most")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--redis", action="store_true",
                   help="share the admission state in a private redis-server")
    p.add_argument("--window", type=int, default=16, help="admission window per worker at most")
    p.add_argument("--redis-stall-every-s", type=float, default=0.0,
                   help="with --redis: stall Redis (DEBUG SLEEP) this often; 0: never")
    p.add_argument("--redis-stall-s", type=float, default=1.0, help="length of one stall")
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--token-scale", type=float, default=0.01)
    p.add_argument("--tool-time-scale", type=float, default=0.2)
    p.add_argument("--time-scale", type=float, default=0.05, help="emulator time scale")
    p.add_argument("--idle-ttl-s", type=float, default=10.0, help="sessions.idle_ttl_s")
    p.add_argument("--sample-every-s", type=float, default=5.0)
    p.add_argument("--warmup-frac", type=float, default=0.1,
                   help="fraction of the run before resources must be flat")
    p.add_argument("--trace", default=None, help="trace file (default: the packaged sample)")
    args = p.parse_args(argv)
    return asyncio.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
