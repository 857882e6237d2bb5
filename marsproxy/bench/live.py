"""``marsproxy bench live``: the policies one after another on the same workload, for real.

For each policy: fresh emulated workers (``marsproxy emulate`` subprocesses; or the given real
vLLM URLs, which are shared by all policies), one ``marsproxy serve --policy NAME`` subprocess in
front of them (none for ``direct``), the proxy's event stream recorded, every session replayed
as an agent (:func:`marsproxy.bench.agent.replay_plan`) with its tool phases as real CPU work on
this host (:mod:`marsproxy.bench.cpuwork`), then everything stopped before the next policy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.bench import options, report
from marsproxy.bench.agent import ReplayOptions, SessionResult, filler, replay_plan
from marsproxy.bench.cpuwork import tool_runner
from marsproxy.bench.ideal import ideal_seconds
from marsproxy.bench.procs import CLI, free_port, wait_up
from marsproxy.bench.progress import Progress
from marsproxy.bench.results import RunResult, SessionOutcome, TurnOutcome
from marsproxy.bench.timeline import timeline
from marsproxy.bench.trace import load_trace
from marsproxy.bench.workload import PlannedSession, Workload, build_workload
from marsproxy.emulator.profiles import EngineProfile, get_profile, profile_names


@dataclass(frozen=True, slots=True)
class LiveSetup:
    profile: str = "tiny"
    time_scale: float = 1.0
    workers: int = 1
    num_blocks: int | None = None
    vllm_urls: tuple[str, ...] = ()
    tool_cpus: float = 0.0
    """CPUs the proxy assumes for tools (probes.cpu.tool_cpus); 0: this host's."""
    report_tools: bool = True
    min_tool_cpu_s: float = 0.05
    system_prompt_tokens: int = 60
    request_timeout_s: float = 900.0
    start_timeout_s: float = 60.0
    sets: dict[str, Any] = field(default_factory=dict)

    def engine_profile(self) -> EngineProfile:
        return get_profile(self.profile, num_blocks=self.num_blocks)


@contextlib.contextmanager
def _process(args: list[str], log: Path, url: str, timeout_s: float) -> Iterator[str]:
    """Run ``args`` until the block ends; yields ``url`` once ``url``/health-ish answers 200."""
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_up(url, proc, timeout_s)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def _workers(setup: LiveSetup, priority: bool, logs: Path) -> Iterator[list[str]]:
    if setup.vllm_urls:
        yield list(setup.vllm_urls)
        return
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(setup.workers):
            port = free_port()
            args = [*CLI, "emulate", "--profile", setup.profile, "--port", str(port),
                    "--time-scale", str(setup.time_scale),
                    "--scheduling-policy", "priority" if priority else "fcfs"]
            if setup.num_blocks is not None:
                args += ["--num-blocks", str(setup.num_blocks)]
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(_process(args, logs / f"worker{i}.log", f"{url}/health",
                                         setup.start_timeout_s))
            urls.append(url)
        yield urls


@contextlib.contextmanager
def _proxy(policy: str, workers: list[str], setup: LiveSetup, out: Path,
           priority: bool = False) -> Iterator[str]:
    port = free_port()
    # Emulated workers started with --scheduling-policy priority are declared so: the proxy
    # then sends levels in the body, as the simulator's default worker mode, instead of
    # holding continuations in its gated dispatch queue.
    listed: list[Any] = [{"url": u, "priority": True} for u in workers] if priority else workers
    tree: dict[str, Any] = {**setup.sets, "workers": listed}
    tree.setdefault("health", {})["interval_s"] = 0.5
    tree.setdefault("server", {})["log_level"] = "warning"
    if setup.tool_cpus > 0:
        tree.setdefault("probes", {}).setdefault("cpu", {})["tool_cpus"] = setup.tool_cpus
    cfg = out / f"proxy-{policy}.yaml"
    cfg.write_text(yaml.safe_dump(tree, sort_keys=False))
    args = [*CLI, "serve", "--config", str(cfg), "--policy", policy, "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with _process(args, out / f"proxy-{policy}.log", f"{url}/readyz", setup.start_timeout_s):
        yield url


async def _record_events(http: aiohttp.ClientSession, url: str, sink: list[dict[str, Any]],
                         ready: asyncio.Event) -> None:
    """Reads ``GET /mars/v1/events`` (NDJSON) into ``sink`` until cancelled.

    Each event is stamped with its arrival here (``recv_ts``, epoch seconds): the stream is
    live, so that is within milliseconds of its publication, and one clock for all events
    (the gateway stamps admission events with its monotonic clock, others with wall time)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    async with http.get(f"{url}/mars/v1/events", params={"format": "ndjson"},
                        timeout=timeout) as resp:
        resp.raise_for_status()
        ready.set()
        async for line in resp.content:
            if line.strip():
                ev = json.loads(line)
                ev["recv_ts"] = time.time()
                sink.append(ev)


_WORKER_COUNTERS = {
    "vllm:num_preemptions_total": "preemptions",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
}


async def _worker_counters(http: aiohttp.ClientSession, urls: list[str]) -> dict[str, float]:
    """Preemptions and prefix-cache counters summed over the workers (their /metrics)."""
    out = dict.fromkeys(_WORKER_COUNTERS.values(), 0.0)
    for url in urls:
        try:
            async with http.get(f"{url}/metrics") as r:
                text = await r.text()
        except aiohttp.ClientError:
            continue  # a worker without metrics adds nothing
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in _WORKER_COUNTERS:
                    out[_WORKER_COUNTERS[s.name]] += s.value
    return out


def _outcome(plan: PlannedSession, res: SessionResult, t0: float, ideal_s: float) -> SessionOutcome:
    o = SessionOutcome(plan.id, plan.arrival_s, ideal_s, len(plan.turns))
    for t in res.turns:
        o.turns.append(TurnOutcome(
            sent_s=t.sent_at - t0, ttft_s=t.ttft_s, latency_s=t.latency_s, status=t.status,
            prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens,
            completion_tokens=t.completion_tokens))
        if not t.ok:
            o.error = t.error
    if len(res.turns) == len(plan.turns) and all(t.ok for t in res.turns):
        o.end_s = res.ended - t0
    return o


async def _replay_all(
    wl: Workload, targets: list[str], proxy: str | None, setup: LiveSetup, bar: Progress,
    workers: list[str],
) -> tuple[list[SessionResult], list[dict[str, Any]], float, float, dict[str, float]]:
    timeout = aiohttp.ClientTimeout(total=setup.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    events: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        async with http.get(f"{targets[0]}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        recorder = None
        if proxy is not None:
            ready = asyncio.Event()
            recorder = asyncio.create_task(_record_events(http, proxy, events, ready))
            await asyncio.wait_for(ready.wait(), 10)
        opts = [ReplayOptions(base_url=url, model=model,
                              system_prompt_tokens=setup.system_prompt_tokens,
                              seed=wl.spec.seed, request_timeout_s=setup.request_timeout_s)
                for url in targets]
        system = filler(setup.system_prompt_tokens, random.Random(wl.spec.seed))

        async def report_tool(session: str, kind: str, tool: str) -> None:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.post(f"{proxy}/mars/v1/sessions/{session}/events",
                                     json={"type": kind, "tool": tool[:64] or "other"}) as r:
                    await r.read()

        on_tool = report_tool if proxy is not None and setup.report_tools else None
        tool = tool_runner(setup.min_tool_cpu_s)
        t0, wall0 = time.perf_counter(), time.time()

        async def one(i: int, plan: PlannedSession) -> SessionResult:
            await asyncio.sleep(max(0.0, t0 + plan.arrival_s - time.perf_counter()))
            res = await replay_plan(http, plan, opts[i % len(opts)], system, tool, on_tool)
            bar.update(1)
            return res

        results = list(await asyncio.gather(*(one(i, p) for i, p in enumerate(wl.sessions))))
        counters = await _worker_counters(http, workers)
        if recorder is not None:
            await asyncio.sleep(0.5)  # the last session_end events
            recorder.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await recorder
    return results, events, t0, wall0, counters


def run_policy(wl: Workload, policy: str, setup: LiveSetup, out: Path,
               progress_out: TextIO | None, label: str) -> RunResult:
    cfg = None if policy == options.DIRECT else options.proxy_config(
        policy, setup.sets, ["http://placeholder"])
    priority = cfg is not None and cfg.scheduler.priority_policy != "off"
    prof = setup.engine_profile()
    with _workers(setup, priority, out) as workers, contextlib.ExitStack() as stack:
        proxy = None if cfg is None else stack.enter_context(
            _proxy(policy, workers, setup, out, priority=priority and not setup.vllm_urls))
        # direct: each agent is configured with one worker URL, round robin (as the sim does).
        targets = [proxy] if proxy else workers
        bar = Progress(f"{label} {policy}", len(wl.sessions), progress_out)
        results, events, t0, wall0, counters = asyncio.run(
            _replay_all(wl, targets, proxy, setup, bar, workers))
        bar.close()
    outcomes = [
        _outcome(p, r, t0, sum(ideal_seconds(p, prof, setup.time_scale)))
        for p, r in zip(wl.sessions, results, strict=True)
    ]
    # Counters of shared real vLLM workers include earlier policies' work.
    return RunResult(policy, "", "", outcomes, timeline(events, wall0, "recv_ts"),
                     {"events": len(events), "stats": counters})


def configure_parser(p: argparse.ArgumentParser) -> None:
    options.add_workload_args(p, sessions=8, rates="0.5", token_scale=0.05,
                              tool_time_scale=0.05, max_turns=12, regimes="trace")
    e = p.add_argument_group("system")
    e.add_argument("--profile", default="tiny", choices=profile_names(),
                   help="emulated workers' engine profile (also prices the ideal times)")
    e.add_argument("--time-scale", type=float, default=1.0,
                   help="emulated workers: wall seconds per modelled second")
    e.add_argument("--workers", type=int, default=1, help="emulated workers")
    e.add_argument("--num-blocks", type=int, default=None, help="KV blocks per emulated worker")
    e.add_argument("--vllm-url", action="append", default=[], metavar="URL",
                   help="use this real vLLM instead of emulated workers (repeatable)")
    e.add_argument("--tool-cpus", type=float, default=0.0,
                   help="CPUs the proxy assumes for tools (0: this host's)")
    e.add_argument("--min-tool-cpu", type=float, default=0.05,
                   help="tool phases shorter than this (s) are waits, not a CPU-burning process")
    e.add_argument("--no-tool-events", action="store_true",
                   help="agents do not report tool_start/tool_end; the proxy infers them")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        cases = options.cases(args, get_profile(
            args.profile, num_blocks=args.num_blocks).effective_max_model_len)
        pols = options.policies(args.policies)
        sets = options.parse_sets(args.sets)
        setup = LiveSetup(
            profile=args.profile, time_scale=args.time_scale, workers=args.workers,
            num_blocks=args.num_blocks, vllm_urls=tuple(args.vllm_url),
            tool_cpus=args.tool_cpus, report_tools=not args.no_tool_events,
            min_tool_cpu_s=args.min_tool_cpu,
            system_prompt_tokens=max(1, round(600 * args.token_scale)), sets=sets)
        setup.engine_profile()
    except ValueError as exc:
        sys.stderr.write(f"marsproxy bench live: {exc}\n")
        return 2
    out = options.out_dir(args.out, "live")
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    traces = load_trace(args.trace)
    t0 = time.perf_counter()
    results: list[RunResult] = []
    for case in cases:
        wl = build_workload(traces, case.spec)
        for policy in pols:
            res = run_policy(wl, policy, setup, logs, sys.stderr, f"{case.regime} {case.load}")
            res.regime, res.load = case.regime, case.load
            res.extra["workload"] = wl.describe()
            results.append(res)
    meta = {
        "kind": "live", "backend": ", ".join(setup.vllm_urls) or
        f"{args.workers} emulated worker(s), profile {args.profile}, time scale {args.time_scale}",
        "host CPUs": os.cpu_count(), "tool_cpus (proxy)": args.tool_cpus or "host",
        "trace": args.trace or "packaged sample", "sessions": args.sessions, "seed": args.seed,
        "arrivals": args.arrivals, "token_scale": args.token_scale,
        "tool_time_scale": args.tool_time_scale, "max_turns": args.max_turns,
        "overrides": sets, "agents report tool events": setup.report_tools,
        "tool phases": f"CPU-burning processes from {args.min_tool_cpu} s, waits below",
        "ideal": "computed from the engine profile and the tool times",
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    path = report.write(out, results, "marsproxy bench live", meta, make_plots=not args.no_plots)
    sys.stdout.write(f"{path}\n")
    return 0
