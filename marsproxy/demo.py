"""``marsproxy demo``: the main job on embedded defaults, in one process.

Two emulated workers (tiny profile) and the proxy start on free loopback ports; a handful of
agent sessions from the packaged trace are replayed through the proxy (staggered arrivals,
streamed turns, tool phases as waits); the workers' ``/metrics`` are sampled while it runs; a
summary is printed. Exit status 0 when every session finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.bench.agent import ReplayOptions, SessionResult, filler, replay_session
from marsproxy.bench.local import LocalServer, start_local
from marsproxy.bench.trace import load_trace, sample_sessions
from marsproxy.config import MarsConfig, load_config
from marsproxy.core.events import Event, SessionAdmitted, SessionQueued, WindowChange
from marsproxy.emulator.server import EmulatorOptions
from marsproxy.emulator.server import create_app as create_worker_app
from marsproxy.gateway.app import GATEWAY_KEY
from marsproxy.gateway.app import create_app as create_gateway_app
from marsproxy.telemetry.bus import Subscription


@dataclass(frozen=True)
class DemoOptions:
    sessions: int = 10
    max_turns: int = 10
    token_scale: float = 0.1
    tool_time_scale: float = 0.1
    time_scale: float = 1.0
    trace: str | None = None
    seed: int = 1
    arrival_gap_s: float = 0.05
    num_blocks: int | None = None
    proxy_port: int = 0
    linger_s: float = 0.0
    out: TextIO = field(default=sys.stdout)


@dataclass
class WorkerSample:
    kv_peak: float = 0.0
    running_peak: float = 0.0
    waiting_peak: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)


def _read_metrics(text: str, prev: WorkerSample) -> WorkerSample:
    """Peaks carried over from ``prev``; counters as the worker reports them now."""
    out = WorkerSample(prev.kv_peak, prev.running_peak, prev.waiting_peak)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:kv_cache_usage_perc":
                out.kv_peak = max(out.kv_peak, s.value)
            elif s.name == "vllm:num_requests_running":
                out.running_peak = max(out.running_peak, s.value)
            elif s.name == "vllm:num_requests_waiting":
                out.waiting_peak = max(out.waiting_peak, s.value)
            elif s.name in (
                "vllm:num_preemptions_total",
                "vllm:prefix_cache_queries_total",
                "vllm:prefix_cache_hits_total",
                "vllm:request_success_total",
            ):
                out.counters[s.name] = out.counters.get(s.name, 0.0) + s.value
    return out


async def _sample_workers(
    http: aiohttp.ClientSession, urls: list[str], samples: list[WorkerSample], stop: asyncio.Event
) -> None:
    while True:
        for i, url in enumerate(urls):
            try:
                async with http.get(f"{url}/metrics") as r:
                    samples[i] = _read_metrics(await r.text(), samples[i])
            except aiohttp.ClientError:
                pass  # a sample missed is only a less precise peak
        if stop.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


def _admission_lines(events: list[Event]) -> list[str]:
    """What the admission window did: sessions held back, and how the window moved."""
    queued = sum(isinstance(e, SessionQueued) for e in events)
    waits = [e.wait_s for e in events if isinstance(e, SessionAdmitted)]
    changes = [e for e in events if isinstance(e, WindowChange)]
    held = [w for w in waits if w > 0]
    lines = [
        f"admission: {len(waits)} sessions admitted, {queued} queued first"
        + (f" (wait mean {1000 * statistics.mean(held):.0f} ms, max {1000 * max(held):.0f} ms)"
           if held else "")
    ]
    by_worker: dict[str, list[WindowChange]] = {}
    for c in changes:
        by_worker.setdefault(c.worker or "?", []).append(c)
    for worker, cs in sorted(by_worker.items()):
        reasons: dict[str, int] = {}
        for c in cs:
            reasons[c.reason] = reasons.get(c.reason, 0) + 1
        low = min(min(c.new, c.old) for c in cs)
        told = ", ".join(f"{r} x{n}" for r, n in sorted(reasons.items()))
        lines.append(
            f"  window {worker}: {cs[0].old:.0f} -> {cs[-1].new:.0f}, lowest {low:.0f}"
            f" ({len(cs)} changes: {told})"
        )
    return lines


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(
    results: list[SessionResult],
    samples: list[WorkerSample],
    urls: list[str],
    wall: float,
    events: list[Event],
) -> str:
    turns = [t for r in results for t in r.turns]
    ok_turns = [t for t in turns if t.ok]
    lines = ["", "marsproxy demo — summary", ""]
    lines.append(f"{'session':<24}{'turns':>6}{'prompt tok':>12}{'cached %':>10}{'e2e s':>9}  ok")
    for r in results:
        prompt = sum(t.prompt_tokens for t in r.turns)
        cached = sum(t.cached_tokens for t in r.turns)
        pct = 100.0 * cached / prompt if prompt else 0.0
        lines.append(
            f"{r.session_id:<24}{len(r.turns):>6}{prompt:>12}{pct:>9.1f}%"
            f"{r.ended - r.started:>9.2f}  {'yes' if r.ok else 'NO'}"
        )
    ttfts = [t.ttft_s for t in ok_turns if t.ttft_s is not None]
    overheads = [t.overhead_ms for t in ok_turns if t.overhead_ms is not None]
    lines.append("")
    lines.append(
        f"sessions finished: {sum(r.ok for r in results)}/{len(results)}   "
        f"LLM calls: {len(ok_turns)} ok, {len(turns) - len(ok_turns)} failed   wall: {wall:.1f} s"
    )
    if ttfts:
        p50, p95 = 1000 * statistics.median(ttfts), 1000 * _pct(ttfts, 0.95)
        lines.append(f"TTFT p50 {p50:.1f} ms, p95 {p95:.1f} ms")
    if overheads:
        lines.append(
            f"proxy overhead (x-marsproxy-overhead-ms) p50 {statistics.median(overheads):.2f} ms,"
            f" p99 {_pct(overheads, 0.99):.2f} ms"
        )
    for url, s in zip(urls, samples, strict=True):
        queries = s.counters.get("vllm:prefix_cache_queries_total", 0.0)
        hits = s.counters.get("vllm:prefix_cache_hits_total", 0.0)
        lines.append(
            f"worker {url}: requests {s.counters.get('vllm:request_success_total', 0):.0f},"
            f" KV usage peak {100 * s.kv_peak:.0f}%, running peak {s.running_peak:.0f},"
            f" waiting peak {s.waiting_peak:.0f},"
            f" preemptions {s.counters.get('vllm:num_preemptions_total', 0):.0f},"
            f" prefix-cache hit rate {100 * hits / queries if queries else 0:.0f}%"
        )
    lines.extend(_admission_lines(events))
    failures = [t.error for t in turns if not t.ok]
    if failures:
        lines.append(f"first failure: {failures[0]}")
    lines.append("deploy it: deploy/README.md · point agents at it: docs/integrations.md")
    return "\n".join(lines) + "\n"


async def run_demo(opts: DemoOptions) -> int:
    traces = sample_sessions(load_trace(opts.trace), opts.sessions, opts.seed)
    worker_opts = EmulatorOptions(
        profile="tiny", time_scale=opts.time_scale, num_blocks=opts.num_blocks
    )
    workers: list[LocalServer] = [
        await start_local(create_worker_app(worker_opts)) for _ in range(2)
    ]
    urls = [w.url for w in workers]
    cfg: MarsConfig = load_config(
        None, environ={}, overrides={"workers": urls, "health": {"interval_s": 0.5}}
    )
    gateway_app = create_gateway_app(cfg)
    watch: Subscription = gateway_app[GATEWAY_KEY].telemetry.bus.subscribe(
        lambda e: isinstance(e, SessionQueued | SessionAdmitted | WindowChange)
    )
    proxy = await start_local(gateway_app, port=opts.proxy_port)
    out = opts.out
    out.write(f"workers: {', '.join(urls)}\nproxy:   {proxy.url}\n")
    out.write(f"watch it live: marsproxy status --url {proxy.url} --watch\n")
    out.write(f"replaying {len(traces)} sessions (at most {opts.max_turns} turns each)...\n")
    out.flush()
    samples = [WorkerSample() for _ in urls]
    stop = asyncio.Event()
    t0 = time.perf_counter()
    try:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async with http.get(f"{proxy.url}/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            sampler = asyncio.create_task(_sample_workers(http, urls, samples, stop))
            replay = ReplayOptions(
                base_url=proxy.url,
                model=model,
                token_scale=opts.token_scale,
                tool_time_scale=opts.tool_time_scale,
                max_turns=opts.max_turns,
                seed=opts.seed,
            )
            system = filler(replay.system_prompt_tokens, random.Random(opts.seed))

            async def one(i: int, trace_index: int) -> SessionResult:
                await asyncio.sleep(i * opts.arrival_gap_s)
                return await replay_session(http, traces[trace_index], replay, system)

            results = list(await asyncio.gather(*(one(i, i) for i in range(len(traces)))))
            stop.set()
            await sampler
        wall = time.perf_counter() - t0
        if opts.linger_s > 0:
            out.write(f"replay done; keeping the proxy up for {opts.linger_s:.0f} s\n")
            out.flush()
            await asyncio.sleep(opts.linger_s)
    finally:
        await proxy.stop()
        for w in workers:
            await w.stop()
    out.write(_summary(results, samples, urls, wall, watch.poll(limit=1 << 20)))
    out.flush()
    return 0 if all(r.ok for r in results) else 1
