"""Part 3 of probes_bench.py: proxy overhead with the information stream off vs on.

Two ``marsproxy emulate --profile zero`` workers and ``marsproxy serve``, each a subprocess;
this process is only the client. See ``STREAM_OFF``/``STREAM_ON`` for exactly what "off" and
"on" mean. Run it through probes_bench.py (its command line is the benchmark's); this module
only holds the part, kept apart so that neither file is over 400 lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
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

from marsproxy.bench.procs import free_port, stop_all, wait_up

CLI = [sys.executable, "-m", "marsproxy.cli"]
# The SSE reader runs as probes_bench.py's hidden --read-sse mode, in a process of its own.
MAIN = Path(__file__).resolve().with_name("probes_bench.py")

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
        wait_up(f"{url}/readyz", proxy)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
            model = json.load(r)["data"][0]["id"]
        reader: subprocess.Popen[bytes] | None = None
        if sse:
            reader = subprocess.Popen(
                [sys.executable, str(MAIN), "--read-sse", f"{url}/mars/v1/events"],
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
        stop_all(procs, timeout_s=15)
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
            wait_up(f"{urls[-1]}/health", p)
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
        stop_all(procs, timeout_s=15)
    return list(merged.values())


def versus(r: ProxyRun, off: ProxyRun) -> str:
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
