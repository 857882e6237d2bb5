"""``marsproxy demo``: the main job on embedded defaults, in one process.

Two emulated workers (tiny profile) and the proxy start on free loopback ports. Agent sessions
from the packaged trace are replayed through the proxy in two phases: a *burst* (many sessions
at once: KV cache and tool backlog pressure rise) and then a *calm* phase (a few small
sessions: pressure falls). The same load runs first without admission control and then with
it, on fresh workers, so the summary can set the engines' preemptions side by side. While the
admission run goes, the window of each worker is sampled and printed as a compact timeline: it
shrinks in the burst and grows back in the calm phase; sessions wait in the queue instead of
thrashing the KV cache.

``--replicas 2`` runs two proxy replicas sharing a redis-server of the demo's own (started on a
free port; the demo says so and stops when ``redis-server`` is not installed): sessions go to
the replicas in turn, and the timeline shows each replica's sessions under one shared window.
Exit status 0 when every session finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.aimd.controller import NO_CEILING
from marsproxy.bench.agent import (
    ReplayOptions,
    SessionResult,
    filler,
    plan_from_trace,
    replay_plan,
)
from marsproxy.bench.local import LocalServer, start_local
from marsproxy.bench.procs import RedisServer
from marsproxy.cli.demo_summary import RunResult, Tick, WorkerSample, summary
from marsproxy.config import MarsConfig, load_config
from marsproxy.core.events import Event, SessionAdmitted, SessionQueued, WindowChange
from marsproxy.emulator.server import EmulatorOptions
from marsproxy.emulator.server import create_app as create_worker_app
from marsproxy.gateway.http.app import GATEWAY_KEY
from marsproxy.gateway.http.app import create_app as create_gateway_app
from marsproxy.gateway.shells.service import Gateway
from marsproxy.policies import policy_preset
from marsproxy.runs.trace import SessionTrace, load_trace, sample_sessions
from marsproxy.telemetry.bus import Subscription


@dataclass(frozen=True)
class DemoOptions:
    sessions: int = 24
    """Sessions of the burst phase."""
    calm_sessions: int = 6
    max_turns: int = 8
    token_scale: float = 0.1
    calm_token_scale: float = 0.03
    """Calm sessions are small: their KV use stays below the low mark."""
    tool_time_scale: float = 0.2
    time_scale: float = 4.0
    """Wall seconds per modelled second of the emulated workers: slow enough that the
    burst's sessions overlap."""
    trace: str | None = None
    seed: int = 1
    arrival_gap_s: float = 0.02
    calm_gap_s: float = 0.1
    num_blocks: int | None = None
    tool_cpus: float = 3.0
    """CPUs the demo declares for tools (probes.cpu.tool_cpus). The agents report their tool
    phases, so the burst raises the tool backlog (CPU overload: the window shrinks) and the
    calm phase lowers it (the window grows back)."""
    compare: bool = True
    """Run the same load without admission first, for the side-by-side preemptions."""
    replicas: int = 1
    policy: str = "mars"
    """Policy preset of the main run (the comparison run is always ``fcfs``: no admission)."""
    sample_s: float = 0.5
    proxy_port: int = 0
    linger_s: float = 0.0
    out: TextIO = field(default=sys.stdout)


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


def _tick(gws: list[Gateway], calm: bool) -> Tick:
    first = gws[0]
    labels = [w.label for w in first.cfg.workers]
    kv: dict[str, float | None] = {}
    for w in labels:
        p = first.telemetry.worker_pressure(w)
        kv[w] = None if p is None or p.metrics is None else p.metrics.kv_usage
    shells = [g.admission for g in gws if g.admission is not None]
    window: dict[str, int] = {}
    limit: dict[str, int | None] = {}  # None: no count bound (not overloaded, no window_max)
    admitted: dict[str, list[int]] = {}
    store: dict[str, int] = {}
    for w in labels:
        if shells:
            c = shells[0].core.controllers[w]
            bound = shells[0].limit(w)
            window[w], limit[w] = c.window, None if bound >= NO_CEILING else bound
            admitted[w] = [s.core.sessions.admitted_on(w) for s in shells]
            store[w] = shells[0].store_admitted(w)
    waiting = [len(s.core.queue) + s.pending for s in shells]
    return Tick(calm, window, limit, admitted, store, kv, waiting,
                first.telemetry.tracker.backlog_ratio(first.telemetry.wall()))


async def _sample(
    http: aiohttp.ClientSession, urls: list[str], samples: list[WorkerSample],
    gws: list[Gateway], timeline: list[Tick], calm: asyncio.Event, stop: asyncio.Event,
    period_s: float,
) -> None:
    next_tick = time.perf_counter()
    while True:
        for i, url in enumerate(urls):
            try:
                async with http.get(f"{url}/metrics") as r:
                    samples[i] = _read_metrics(await r.text(), samples[i])
            except aiohttp.ClientError:
                pass  # a sample missed is only a less precise peak
        if time.perf_counter() >= next_tick:
            timeline.append(_tick(gws, calm.is_set()))
            next_tick += period_s
        if stop.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


def _watched(e: Event) -> bool:
    return isinstance(e, SessionQueued | SessionAdmitted | WindowChange)


def _watched_sessions(e: Event) -> bool:
    return isinstance(e, SessionQueued | SessionAdmitted)


def _renamed(traces: list[SessionTrace], prefix: str) -> list[SessionTrace]:
    # Phases reuse the small packaged trace: give each replayed session an id of its own.
    return [dataclasses.replace(t, id=f"{prefix}{i}-{t.id}") for i, t in enumerate(traces)]


async def _run_once(
    opts: DemoOptions, label: str, policy: str, redis_url: str | None, announce: bool
) -> RunResult:
    all_traces = load_trace(opts.trace)
    burst = _renamed(sample_sessions(all_traces, opts.sessions, opts.seed), "burst")
    while len(burst) < opts.sessions:  # more sessions than the trace has: go round again
        more = sample_sessions(all_traces, opts.sessions - len(burst), opts.seed + len(burst))
        burst += _renamed(more, f"burst{len(burst)}-")
    calm = _renamed(sample_sessions(all_traces, opts.calm_sessions, opts.seed + 1), "calm")
    worker_opts = EmulatorOptions(
        profile="tiny", time_scale=opts.time_scale, num_blocks=opts.num_blocks
    )
    workers: list[LocalServer] = [
        await start_local(create_worker_app(worker_opts)) for _ in range(2)
    ]
    urls = [w.url for w in workers]
    overrides: dict[str, Any] = {
        "workers": [{"url": u, "name": f"w{i}"} for i, u in enumerate(urls)],
        "health": {"interval_s": 0.5},
        "probes": {"cpu": {"tool_cpus": opts.tool_cpus}, "nvml": {"enabled": False}},
        "policy": policy,
        # Growth needs a used window (app-limited guard): the calm phase is small on purpose.
        "admission": {"tuning": {"app_limited_frac": 0.25}},
    }
    if redis_url is not None:
        overrides["store"] = {"backend": "redis", "redis_url": redis_url, "pool": "demo",
                              "lease_ttl_s": 5.0, "heartbeat_interval_s": 1.0,
                              "leader_ttl_s": 2.0}
    cfg: MarsConfig = load_config(None, environ={}, overrides=overrides)
    apps = [create_gateway_app(cfg) for _ in range(opts.replicas if redis_url else 1)]
    gws = [app[GATEWAY_KEY] for app in apps]
    # Every replica's own events (windows: the first replica's, they share the leader's).
    watches: list[Subscription] = [
        g.telemetry.bus.subscribe(_watched if i == 0 else _watched_sessions)
        for i, g in enumerate(gws)
    ]
    proxies = [
        await start_local(app, port=opts.proxy_port if i == 0 else 0)
        for i, app in enumerate(apps)
    ]
    out = opts.out
    if announce:
        out.write(f"workers: {', '.join(urls)}\n")
        out.write(f"proxy:   {', '.join(p.url for p in proxies)}\n")
        out.write(f"watch it live: {proxies[0].url}/mars/ui in a browser"
                  f" (or marsproxy status --url {proxies[0].url} --watch)\n")
    out.write(f"[{label}] burst of {len(burst)} sessions, then {len(calm)} calm ones "
              f"(at most {opts.max_turns} turns each)...\n")
    out.flush()
    samples = [WorkerSample() for _ in urls]
    timeline: list[Tick] = []
    stop, calm_on = asyncio.Event(), asyncio.Event()
    t0 = time.perf_counter()
    try:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async with http.get(f"{proxies[0].url}/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            sampler = asyncio.create_task(
                _sample(http, urls, samples, gws, timeline, calm_on, stop, opts.sample_s)
            )

            def replay_opts(i: int, scale: float) -> ReplayOptions:
                return ReplayOptions(
                    base_url=proxies[i % len(proxies)].url, model=model, token_scale=scale,
                    tool_time_scale=opts.tool_time_scale, max_turns=opts.max_turns,
                    seed=opts.seed,
                )

            system = filler(replay_opts(0, 1.0).system_prompt_tokens, random.Random(opts.seed))

            async def one(i: int, trace: SessionTrace, delay: float,
                          scale: float) -> SessionResult:
                await asyncio.sleep(delay)
                ro = replay_opts(i, scale)

                async def report(session: str, kind: str, tool: str) -> None:
                    # As an agent harness does: tool phases reported, so they count at once.
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.post(f"{ro.base_url}/mars/v1/sessions/{session}/events",
                                             json={"type": kind, "tool": tool[:64] or "other"}
                                             ) as r:
                            await r.read()

                return await replay_plan(http, plan_from_trace(trace, ro), ro, system,
                                         on_tool=report)

            results = list(await asyncio.gather(*(
                one(i, t, i * opts.arrival_gap_s, opts.token_scale) for i, t in enumerate(burst)
            )))
            calm_on.set()
            results += await asyncio.gather(*(
                one(i, t, i * opts.calm_gap_s, opts.calm_token_scale)
                for i, t in enumerate(calm)
            ))
            await asyncio.sleep(opts.sample_s * 2)  # the window keeps growing a moment
            stop.set()
            await sampler
        wall = time.perf_counter() - t0
        if opts.linger_s > 0:
            out.write(f"replay done; keeping the proxy up for {opts.linger_s:.0f} s:"
                      f" {proxies[0].url}/mars/ui\n")
            out.flush()
            await asyncio.sleep(opts.linger_s)
    finally:
        for p in proxies:
            await p.stop()
        for w in workers:
            await w.stop()
    events = [e for w in watches for e in w.poll(limit=1 << 20)]
    return RunResult(label, results, samples, urls, wall, events, timeline)


async def run_demo(opts: DemoOptions) -> int:
    out = opts.out
    redis: RedisServer | None = None
    tmp: tempfile.TemporaryDirectory[str] | None = None
    if opts.replicas > 1:
        if not RedisServer.available():
            out.write(f"--replicas {opts.replicas} needs redis-server (the replicas share "
                      "their admission state in Redis); it is not installed here, so this "
                      "part of the demo is skipped. Install it (e.g. `apt-get install "
                      "redis-server`) or run the demo without --replicas.\n")
            out.flush()
            return 0
        tmp = tempfile.TemporaryDirectory(prefix="marsproxy-demo-redis-")
        redis = RedisServer(tmp.name)
        redis.start()
        out.write(f"redis-server of the demo's own: {redis.url} "
                  f"({opts.replicas} replicas share the admission window there)\n")
    try:
        runs = []
        if opts.compare:
            runs.append(await _run_once(opts, "without admission", "fcfs", None, True))
        url = None if redis is None else redis.url
        admits = policy_preset(opts.policy).get("admission", {}).get("enabled", True)
        label = "with admission" if opts.policy == "mars" else (
            f"policy {opts.policy}" + (" (admission on)" if admits else " (admission off)"))
        runs.append(await _run_once(opts, label, opts.policy, url, not opts.compare))
    finally:
        if redis is not None:
            redis.kill()
        if tmp is not None:
            tmp.cleanup()
    out.write(summary(runs, opts.sample_s, opts.replicas))
    out.flush()
    return 0 if all(r.ok for run in runs for r in run.results) else 1
