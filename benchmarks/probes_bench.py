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
   ``STREAM_OFF``/``STREAM_ON`` for exactly what "off" and "on" mean.

Goals from the issue: one scrape < 2 ms CPU; the stream adds < 5 % to proxy overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from aiohttp import web

from marsproxy.core.events import Dispatch, Event
from marsproxy.probes.vllm_metrics import parse_vllm_metrics
from marsproxy.probes.vllm_scraper import VllmScraper
from marsproxy.telemetry.bus import EventBus

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "vllm-0.32-metrics.txt"
CLI = [sys.executable, "-m", "marsproxy.cli"]

# What "off" means: the gateway has no single switch for the stream, so every periodic
# producer is slowed to once an hour (one scrape at start, none during the run), NVML is
# disabled, no JSONL/Redis sink, and nobody subscribes to /mars/v1/events. Events that the
# request path itself publishes (dispatch, llm_end, ...) still go into the bus ring: they
# cannot be turned off by config, so "off" is an upper bound of what the stream costs.
STREAM_OFF: dict[str, Any] = {
    "probes": {
        "vllm": {"period_s": 3600.0, "stale_after_s": 7200.0},
        "cpu": {"period_s": 3600.0},
        "nvml": {"enabled": False},
    },
}
# "on": the defaults (vLLM /metrics of each worker every 0.2 s, CPU every 1 s, NVML enabled
# when there is a GPU) plus one SSE client on /mars/v1/events reading every event.
STREAM_ON: dict[str, Any] = {}
# (name, config overrides, SSE subscriber?). "probes" (defaults, no subscriber) sits between
# the two so that the cost of scraping and the cost of serving the stream can be told apart.
MODES: tuple[tuple[str, dict[str, Any], bool], ...] = (
    ("off", STREAM_OFF, False),
    ("probes", STREAM_ON, False),
    ("on", STREAM_ON, True),
)


# -- helpers ----------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by nearest rank (NaN for no values)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not up after {timeout_s} s")


def stop_procs(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


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


# -- 3. proxy overhead ----------------------------------------------------------------------


def read_sse(url: str) -> None:
    """Hidden mode (subprocess): read ``url`` as an event stream until SIGTERM; print counts."""
    events = 0
    nbytes = 0
    status = 0

    def done(*_: Any) -> None:
        print(json.dumps({"status": status, "events": events, "bytes": nbytes}), flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, done)
    try:
        with urllib.request.urlopen(url, timeout=3600) as r:
            status = r.status
            print("connected", flush=True)
            for line in r:
                nbytes += len(line)
                if line.startswith(b"data:"):
                    events += 1
    except urllib.error.HTTPError as exc:
        status = exc.code
        print("connected", flush=True)
    except OSError:
        print("connected", flush=True)
    signal.pause()


@dataclass
class ProxyRun:
    mode: str
    overhead_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0
    proxy_cpu_s: float = 0.0
    sse: dict[str, Any] | None = None


async def _load(
    url: str, model: str, n: int, concurrency: int, run: ProxyRun | None
) -> None:
    """``n`` small non-streaming chats at ``concurrency``; recorded into ``run`` if given."""
    counter = iter(range(n))
    timeout = aiohttp.ClientTimeout(total=60)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:

        async def client(c: int) -> None:
            for i in counter:
                body = {
                    "model": model, "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"request {i}: say hello"}],
                }
                # One-shot sessions: each request is final, so admission never holds a slot.
                headers = {"x-session-id": f"bench-{c}-{i % 16}", "x-session-final": "true"}
                t0 = time.perf_counter()
                try:
                    async with http.post(
                        f"{url}/v1/chat/completions", json=body, headers=headers
                    ) as r:
                        await r.read()
                        ok = r.status == 200
                        oh = r.headers.get("x-marsproxy-overhead-ms")
                except (aiohttp.ClientError, TimeoutError):
                    ok, oh = False, None
                if run is None:
                    continue
                if not ok:
                    run.errors += 1
                    continue
                run.latency_ms.append((time.perf_counter() - t0) * 1000)
                if oh is not None:
                    run.overhead_ms.append(float(oh))

        await asyncio.gather(*(client(c) for c in range(concurrency)))


def _yaml(cfg: dict[str, Any]) -> str:
    return json.dumps(cfg)  # JSON is YAML; no need for a YAML writer here


def bench_proxy_mode(
    mode: str, overrides: dict[str, Any], worker_urls: list[str], sse: bool,
    requests: int, concurrency: int, warmup: int, tmp: Path,
) -> ProxyRun:
    cfg = {
        "workers": [{"url": u, "name": f"w{i}"} for i, u in enumerate(worker_urls)],
        **overrides,
    }
    cfg_path = tmp / f"marsproxy-{mode}.yaml"
    cfg_path.write_text(_yaml(cfg))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []
    run = ProxyRun(mode)
    try:
        proxy = subprocess.Popen(
            [*CLI, "serve", "--config", str(cfg_path), "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        procs.append(proxy)
        wait_http(f"{url}/readyz", proxy)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
            model = json.load(r)["data"][0]["id"]
        reader: subprocess.Popen[bytes] | None = None
        if sse:
            reader = subprocess.Popen(
                [sys.executable, __file__, "--read-sse", f"{url}/mars/v1/events"],
                stdout=subprocess.PIPE,
            )
            procs.append(reader)
            assert reader.stdout is not None
            reader.stdout.readline()  # "connected"
        asyncio.run(_load(url, model, warmup, concurrency, None))
        time.sleep(0.5)  # let the scrapers run a few periods before measuring
        ps = psutil.Process(proxy.pid)
        c0 = ps.cpu_times()
        t0 = time.perf_counter()
        asyncio.run(_load(url, model, requests, concurrency, run))
        run.wall_s = time.perf_counter() - t0
        c1 = ps.cpu_times()
        run.proxy_cpu_s = (c1.user + c1.system) - (c0.user + c0.system)
        if reader is not None:
            reader.terminate()
            assert reader.stdout is not None
            out = reader.stdout.read().decode().strip().splitlines()
            reader.wait(timeout=10)
            run.sse = json.loads(out[-1]) if out else None
    finally:
        stop_procs(procs)
    return run


def bench_proxy(requests: int, concurrency: int, warmup: int, rounds: int) -> list[ProxyRun]:
    procs: list[subprocess.Popen[bytes]] = []
    merged = {mode: ProxyRun(mode) for mode, _, _ in MODES}
    try:
        urls = []
        for _ in range(2):
            port = free_port()
            p = subprocess.Popen(
                [*CLI, "emulate", "--profile", "zero", "--port", str(port)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            procs.append(p)
            urls.append(f"http://127.0.0.1:{port}")
            wait_http(f"{urls[-1]}/health", p)
        with tempfile.TemporaryDirectory() as tmp:
            # Alternate off/on so that a noisy neighbour hurts both modes alike.
            for r in range(rounds):
                for mode, over, sse in MODES:
                    one = bench_proxy_mode(
                        mode, over, urls, sse, requests, concurrency, warmup, Path(tmp)
                    )
                    print(
                        f"  round {r + 1} {mode:>6}: overhead p50"
                        f" {statistics.median(one.overhead_ms or [float('nan')]):.3f} ms,"
                        f" {one.errors} errors, SSE {one.sse}", flush=True,
                    )
                    m = merged[mode]
                    m.overhead_ms += one.overhead_ms
                    m.latency_ms += one.latency_ms
                    m.errors += one.errors
                    m.wall_s += one.wall_s
                    m.proxy_cpu_s += one.proxy_cpu_s
                    if one.sse is not None:
                        m.sse = one.sse
    finally:
        stop_procs(procs)
    return list(merged.values())


def _versus(r: ProxyRun, off: ProxyRun) -> str:
    """``r`` relative to ``off``: overhead p50/p99, client p50 and proxy CPU per request."""

    def rel(a: float, b: float) -> str:
        return f"{100 * (a / b - 1):+.1f} %"

    o50, n50 = statistics.median(off.overhead_ms), statistics.median(r.overhead_ms)
    cpu_off = off.proxy_cpu_s / max(1, len(off.latency_ms))
    cpu_r = r.proxy_cpu_s / max(1, len(r.latency_ms))
    return (
        f"{r.mode}/off: overhead p50 {rel(n50, o50)},"
        f" p99 {rel(pct(r.overhead_ms, 0.99), pct(off.overhead_ms, 0.99))},"
        f" client p50 {rel(statistics.median(r.latency_ms), statistics.median(off.latency_ms))},"
        f" proxy CPU/request {rel(cpu_r, cpu_off)}"
        f"   (goal: overhead p50 < +5 %: {'met' if n50 / o50 < 1.05 else 'NOT met'})"
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
        print("  " + _versus(r, off))
    on = runs[-1]
    if on.sse is None or on.sse.get("status") != 200:
        print("  ! the SSE subscriber did not get a 200 stream: /mars/v1/events missing?")
    return 0


if __name__ == "__main__":
    sys.exit(main())
