"""Cost of the unified information stream (issue 3): prints numbers, asserts nothing.

    .venv/bin/python benchmarks/probes_bench.py [--requests 2000] [--concurrency 8] ...

1. CPU of one ``parse_vllm_metrics`` of a real vLLM 0.32 page, and of one scrape+parse through
   HTTP (``VllmScraper.scrape_once``; the page is served by a subprocess so that only the
   scraper's CPU is in this process's ``process_time``).
2. ns per ``EventBus.publish`` with 0, 1 and 10 subscribers (asyncio tasks that drain between
   batches, so drop counting is not what is measured), and with one subscriber that never
   reads (the publisher must not slow down; its loss is counted).
3. Proxy overhead with the stream on vs off: two ``marsproxy emulate --profile zero`` workers
   and ``marsproxy serve``, each a subprocess; this process is only the client. See
   ``STREAM_OFF``/``STREAM_ON`` (probes_bench_proxy.py, where this part's code is) for exactly
   what "off" and "on" mean.

Goals from the issue: one scrape < 2 ms CPU; the stream adds < 5 % to proxy overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

# Part 3 (proxy overhead); a sibling module: this script's directory is on sys.path.
from probes_bench_proxy import STREAM_OFF, bench_proxy, pct, read_sse, versus

from marsproxy.core.events import Dispatch, Event
from marsproxy.probes.vllm_metrics import parse_vllm_metrics
from marsproxy.probes.vllm_scraper import VllmScraper
from marsproxy.telemetry.bus import EventBus

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "vllm-0.32-metrics.txt"


# -- 1. parse and scrape ------------------------------------------------------------------------


def bench_parse(text: str, runs: int) -> float:
    """Mean CPU seconds of one parse."""
    parse_vllm_metrics(text, 0.0)  # warm caches and imports outside the measurement
    t0 = time.process_time()
    for i in range(runs):
        parse_vllm_metrics(text, float(i))
    return (time.process_time() - t0) / runs


def serve_metrics(path: str) -> None:
    """Hidden mode (subprocess): serve ``path`` at /metrics, print the port, run until killed."""
    body = Path(path).read_bytes()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain")

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        print(sock.getsockname()[1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


async def _scrape(url: str, runs: int) -> tuple[float, float, int]:
    async with aiohttp.ClientSession() as http:
        scraper = VllmScraper([("w", url)], http, timeout_s=5.0)
        for _ in range(10):  # connection set up, caches warm
            await scraper.scrape_once("w")
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(runs):
            await scraper.scrape_once("w")
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        return cpu / runs, wall / runs, scraper.snapshot("w").scrape_errors


def bench_scrape(runs: int) -> tuple[float, float]:
    """(mean CPU s, mean wall s) of one ``scrape_once`` against a page served by a subprocess."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve-metrics", str(FIXTURE)], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        cpu, wall, errors = asyncio.run(_scrape(f"http://127.0.0.1:{port}/", runs))
        if errors:
            print(f"  ! {errors} scrape errors during the scrape benchmark")
        return cpu, wall
    finally:
        proc.kill()
        proc.wait()


# -- 2. event bus -------------------------------------------------------------------------------


@dataclass
class BusResult:
    label: str
    ns_per_publish: float
    delivered: int = 0
    dropped: int = 0


def _event() -> Event:
    # A typical hot-path event: what the relay publishes when it dispatches a request.
    return Dispatch(
        ts=time.time(), session="3f2a9c1b77e0/id/agent-42", worker="127.0.0.1:8001",
        route="chat", turn=7, level=None, hint="affinity",
    )


async def bench_bus(subscribers: int, batches: int, batch: int) -> BusResult:
    """ns per publish with ``subscribers`` reader tasks, drained between batches."""
    bus = EventBus()
    ev = _event()
    seen = [0] * subscribers
    target = 0
    drained = asyncio.Event()

    async def reader(i: int) -> None:
        sub = bus.subscribe()
        try:
            while True:
                seen[i] += len(await sub.get_batch(limit=1 << 20))
                if all(n >= target for n in seen):
                    drained.set()
        finally:
            sub.close()

    tasks = [asyncio.create_task(reader(i)) for i in range(subscribers)]
    await asyncio.sleep(0)  # let the readers subscribe and start waiting
    publish = bus.publish
    timed = 0
    for b in range(batches):
        target = (b + 1) * batch
        drained.clear()
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            publish(ev)
        timed += time.perf_counter_ns() - t0
        # Drain outside the timing: the readers wake and catch up before the next batch,
        # so the ring never overflows and drop counting stays out of the measurement.
        if subscribers:
            await drained.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return BusResult(
        f"{subscribers} subscriber{'s' if subscribers != 1 else ''}, drained",
        timed / (batches * batch), delivered=sum(seen), dropped=bus.dropped_total,
    )


async def bench_bus_stuck(total: int, capacity: int) -> BusResult:
    """One subscriber that never reads while ``total`` events are published."""
    bus = EventBus(capacity=capacity)
    ev = _event()
    sub = bus.subscribe()
    publish = bus.publish
    t0 = time.perf_counter_ns()
    for _ in range(total):
        publish(ev)
    ns = (time.perf_counter_ns() - t0) / total
    got = len(sub.poll(limit=1 << 30))  # the loss is counted when the reader comes back
    sub.close()
    return BusResult(
        f"1 subscriber never reading (ring {capacity})", ns, delivered=got,
        dropped=bus.dropped_total,
    )


# -- main -------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--parse-runs", type=int, default=300, help="parses to average (default 300)")
    p.add_argument("--scrape-runs", type=int, default=300, help="scrapes to average (default 300)")
    p.add_argument("--bus-batches", type=int, default=200, help="publish batches (default 200)")
    p.add_argument("--bus-batch", type=int, default=1000, help="events per batch (default 1000)")
    p.add_argument("--requests", type=int, default=2000, help="per mode and round (default 2000)")
    p.add_argument("--concurrency", type=int, default=8, help="client concurrency (default 8)")
    p.add_argument("--warmup", type=int, default=200, help="unmeasured requests (default 200)")
    p.add_argument("--rounds", type=int, default=2, help="off/on alternations (default 2)")
    p.add_argument("--skip-proxy", action="store_true", help="only the in-process benchmarks")
    p.add_argument("--serve-metrics", help=argparse.SUPPRESS)
    p.add_argument("--read-sse", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_metrics:
        serve_metrics(args.serve_metrics)
        return 0
    if args.read_sse:
        read_sse(args.read_sse)
        return 0

    print(f"marsproxy probes benchmark — {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    text = FIXTURE.read_text()
    print(f"\n1. vLLM /metrics: {FIXTURE.name}, {len(text.splitlines())} lines, {len(text)} bytes")
    parse_s = bench_parse(text, args.parse_runs)
    scrape_cpu, scrape_wall = bench_scrape(args.scrape_runs)
    print(
        f"  parse_vllm_metrics           {parse_s * 1e3:8.3f} ms CPU"
        f"  (mean of {args.parse_runs})"
    )
    print(
        f"  scrape_once (HTTP + parse)   {scrape_cpu * 1e3:8.3f} ms CPU,"
        f" {scrape_wall * 1e3:.3f} ms wall  (mean of {args.scrape_runs}; goal < 2 ms CPU:"
        f" {'met' if scrape_cpu < 2e-3 else 'NOT met'})"
    )

    print(f"\n2. EventBus.publish ({args.bus_batches} x {args.bus_batch} events)")

    async def buses() -> list[BusResult]:
        out = [await bench_bus(n, args.bus_batches, args.bus_batch) for n in (0, 1, 10)]
        out.append(await bench_bus_stuck(args.bus_batches * args.bus_batch, 65_536))
        return out

    for b in asyncio.run(buses()):
        print(
            f"  {b.label:<40} {b.ns_per_publish:8.1f} ns/publish"
            f"   delivered {b.delivered}, dropped {b.dropped}"
        )

    if args.skip_proxy:
        return 0
    print(
        f"\n3. proxy overhead, stream off vs on: 2 workers (profile zero), {args.requests}"
        f" non-streaming chats x {args.rounds} rounds per mode, concurrency {args.concurrency}"
    )
    print(f"  off = {json.dumps(STREAM_OFF)}, no SSE subscriber")
    print("  probes = defaults (vLLM scrape 0.2 s, CPU 1 s), no SSE subscriber")
    print("  on  = defaults + 1 SSE subscriber (a subprocess) on /mars/v1/events reading all")
    runs = bench_proxy(args.requests, args.concurrency, args.warmup, args.rounds)
    print(
        f"\n  {'mode':<7}{'ok':>6}{'err':>5}  {'overhead p50':>12}{'p99':>8}"
        f"  {'client p50':>10}{'p99':>8}  {'proxy CPU/req':>13}  {'req/s':>7}  SSE events"
    )
    for r in runs:
        n = len(r.latency_ms)
        print(
            f"  {r.mode:<7}{n:>6}{r.errors:>5}  {statistics.median(r.overhead_ms):>9.3f} ms"
            f"{pct(r.overhead_ms, 0.99):>8.3f}  {statistics.median(r.latency_ms):>7.2f} ms"
            f"{pct(r.latency_ms, 0.99):>8.2f}  {r.proxy_cpu_s / max(1, n) * 1e3:>10.3f} ms"
            f"  {n / r.wall_s if r.wall_s else 0:>7.0f}  {r.sse or '-'}"
        )
    off = runs[0]
    print()
    for r in runs[1:]:
        print("  " + versus(r, off))
    on = runs[-1]
    if on.sse is None or on.sse.get("status") != 200:
        print("  ! the SSE subscriber did not get a 200 stream: /mars/v1/events missing?")
    return 0


if __name__ == "__main__":
    sys.exit(main())
