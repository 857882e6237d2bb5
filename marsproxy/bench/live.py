"""``marsproxy bench live``: the policies one after another on the same workload, for real.

For each policy: fresh emulated workers (``marsproxy emulate`` subprocesses; or the given real
vLLM URLs, which are shared by all policies and have their prefix cache emptied before each:
:mod:`marsproxy.bench.live_vllm`), one ``marsproxy serve --policy NAME`` subprocess in
front of them (none for ``direct``), the proxy's event stream recorded, every session replayed
as an agent (:func:`marsproxy.bench.agent.replay_plan`) with its tool phases as real CPU work on
this host (:mod:`marsproxy.bench.cpuwork`), then everything stopped before the next policy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from marsproxy.bench.agent import ReplayOptions, SessionResult, filler, replay_plan
from marsproxy.bench.cpuwork import tool_runner
from marsproxy.bench.live_record import (
    WORKER_COUNTERS,
    record_events,
    record_state,
    worker_counters,
)
from marsproxy.bench.live_setup import CALL_TIMEOUT_S, LiveSetup, start_proxy, start_workers
from marsproxy.bench.live_vllm import VllmFacts, calibrate, reset_prefix_cache
from marsproxy.bench.live_vllm import ideal_seconds as vllm_ideal_seconds
from marsproxy.bench.procs import cpu_mark, cpu_since
from marsproxy.config import UpstreamConfig
from marsproxy.emulator.profiles import get_profile, profile_names
from marsproxy.runs import options, report
from marsproxy.runs.ideal import ideal_seconds
from marsproxy.runs.progress import Progress
from marsproxy.runs.results import RunResult, SessionOutcome, TurnOutcome, write_log
from marsproxy.runs.timeline import timeline
from marsproxy.runs.trace import load_trace
from marsproxy.runs.workload import PlannedSession, Workload, build_workload

# Agents close idle connections before a worker does (vLLM's uvicorn after 5 s), as the proxy's
# upstream pool does: a call sent as the server closes its connection fails ("Server
# disconnected"); with aiohttp's 15 s that lost 1 and 3 of 24 direct sessions in two real-vLLM runs.
AGENT_KEEPALIVE_S = UpstreamConfig().keepalive_timeout_s


def _outcome(plan: PlannedSession, res: SessionResult, t0: float, ideal_s: float) -> SessionOutcome:
    o = SessionOutcome(plan.id, plan.arrival_s, ideal_s, len(plan.turns), group=plan.mix)
    for t in res.turns:
        o.turns.append(TurnOutcome(
            sent_s=t.sent_at - t0, ttft_s=t.ttft_s, latency_s=t.latency_s, status=t.status,
            prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens,
            completion_tokens=t.completion_tokens))
        if not t.ok:
            o.error = t.error
    if len(res.turns) == len(plan.turns) and all(t.ok for t in res.turns):
        o.end_s = res.ended - t0
    else:
        o.stopped_s = res.ended - t0  # the refusal or failed call: the agent stopped there
    return o


def agents_http(request_timeout_s: float, keepalive_s: float = AGENT_KEEPALIVE_S,
                ) -> aiohttp.ClientSession:
    """The agents' HTTP client: unbounded connections, idle ones closed after ``keepalive_s``."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=request_timeout_s),
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_s))


async def _replay_all(
    wl: Workload, targets: list[str], proxy: str | None, setup: LiveSetup, bar: Progress,
    workers: list[str], states: list[dict[str, Any]],
) -> tuple[list[SessionResult], list[dict[str, Any]], float, float, dict[str, float]]:
    events: list[dict[str, Any]] = []
    async with agents_http(setup.request_timeout_s) as http:
        async with http.get(f"{targets[0]}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        before = (await worker_counters(http, workers) if setup.vllm_urls
                  else dict.fromkeys(WORKER_COUNTERS.values(), 0.0))
        recorder = None
        if proxy is not None:
            ready = asyncio.Event()
            recorder = asyncio.create_task(record_events(http, proxy, events, ready))
            await asyncio.wait_for(ready.wait(), 10)
        poller = None
        if proxy is not None and setup.state_every_s > 0:
            poller = asyncio.create_task(record_state(http, proxy, states, setup.state_every_s))
        cpt = setup.vllm.chars_per_token if setup.vllm else 4.0
        opts = [ReplayOptions(base_url=url, model=model,
                              system_prompt_tokens=setup.system_prompt_tokens,
                              seed=wl.spec.seed, request_timeout_s=setup.request_timeout_s,
                              # Tool calls' JSON in the history: sized from the usage too.
                              chars_per_token=cpt,
                              follow_usage=setup.vllm is not None or setup.tool_calls,
                              plain=setup.plain_clients, tool_calls=setup.tool_calls)
                for url in targets]
        system = filler(setup.system_prompt_tokens, random.Random(wl.spec.seed), cpt)

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
        after = await worker_counters(http, workers)
        counters = {k: v - before.get(k, 0.0) for k, v in after.items()}
        if recorder is not None:
            await asyncio.sleep(0.5)  # the last session_end events
        for task in (recorder, poller):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await task
    return results, events, t0, wall0, counters


async def _reset_workers(urls: list[str]) -> list[bool | None]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        return [await reset_prefix_cache(http, u) for u in urls]


def _ideal(plan: PlannedSession, setup: LiveSetup) -> float:
    if setup.vllm is not None:
        return sum(vllm_ideal_seconds(plan, setup.vllm))
    return sum(ideal_seconds(plan, setup.engine_profile(), setup.time_scale))


def run_policy(wl: Workload, policy: str, setup: LiveSetup, out: Path,
               progress_out: TextIO | None, label: str) -> RunResult:
    cfg = None if policy == options.DIRECT else options.proxy_config(
        policy, setup.sets, ["http://placeholder"])
    priority = cfg is not None and cfg.scheduler.priority_policy != "off"
    extra: dict[str, Any] = {"loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    if setup.vllm_urls:
        # Real workers outlive the policies: start each one from an empty prefix cache.
        extra["prefix_cache_reset"] = asyncio.run(_reset_workers(list(setup.vllm_urls)))
    kv: dict[str, dict[str, str]] = {}
    with start_workers(setup, priority, out, kv) as workers, contextlib.ExitStack() as stack:
        started = None if cfg is None else stack.enter_context(start_proxy(
            policy, workers, setup, out, priority=priority and not setup.vllm_urls, kv=kv))
        proxy, pid = (None, None) if started is None else (started.url, started.pid)
        # direct: each agent is configured with one worker URL, round robin (as the sim does).
        targets = [proxy] if proxy else workers
        bar = Progress(f"{label} {policy}", len(wl.sessions), progress_out)
        states: list[dict[str, Any]] = []
        # What the run costs the host, the proxy's share apart: on a small host the proxy's
        # CPU is taken from the engine's and the tools'.
        mark = cpu_mark(pid)
        results, events, t0, wall0, counters = asyncio.run(
            _replay_all(wl, targets, proxy, setup, bar, workers, states))
        extra["cpu"] = cpu_since(mark, pid)
    outcomes = [
        _outcome(p, r, t0, _ideal(p, setup))
        for p, r in zip(wl.sessions, results, strict=True)
    ]
    bar.close(report.done_note(RunResult(policy, "", "", outcomes)))
    extra["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    # The proxy's whole event stream and its state over time, to find out why a policy won or
    # lost (the state holds what no event carries: caps, the fit's factor, the queue).
    for kind, rows in (("events", events), ("state", states)):
        write_log(out, kind, label, policy, rows)
    return RunResult(policy, "", "", outcomes, timeline(events, wall0, "recv_ts"),
                     {"events": len(events), "state_snapshots": len(states), "stats": counters,
                      **extra})


def configure_parser(p: argparse.ArgumentParser) -> None:
    options.add_workload_args(p, sessions=8, rates="0.5", token_scale=0.05,
                              tool_time_scale=0.05, max_turns=12, regimes="trace")
    options.add_mix_args(p)
    e = p.add_argument_group("system")
    e.add_argument("--profile", default="tiny", choices=profile_names(),
                   help="emulated workers' engine profile (also prices the ideal times; with"
                   " --vllm-url the server's measured speed does)")
    e.add_argument("--time-scale", type=float, default=1.0,
                   help="emulated workers: wall seconds per modelled second")
    e.add_argument("--workers", type=int, default=1, help="emulated workers")
    e.add_argument("--num-blocks", type=int, default=None, help="KV blocks per emulated worker")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="emulated workers' longest context, as vLLM's (default: profile)")
    e.add_argument("--vllm-url", action="append", default=[], metavar="URL",
                   help="use this real vLLM instead of emulated workers (repeatable); its"
                   " model, context, tokenizer and speed are measured first, and its prefix cache"
                   " is emptied before each policy (needs VLLM_SERVER_DEV_MODE=1 on the server)")
    e.add_argument("--vllm-priority", choices=("true", "false", "auto"), default="auto",
                   help="the real workers run --scheduling-policy priority: true, false (the"
                   " proxy gates dispatch itself) or auto (the proxy probes at start)")
    e.add_argument("--vllm-kv-events", action="append", default=[], metavar="ENDPOINT[,REPLAY]",
                   help="the --vllm-url of the same position publishes KV events here (its"
                   " --kv-events-config endpoint, with topic 'kv', and optionally its replay"
                   " endpoint, e.g. tcp://127.0.0.1:5557,tcp://127.0.0.1:5558): the proxy"
                   " subscribes to them")
    e.add_argument("--tool-cpus", type=float, default=0.0,
                   help="CPUs the proxy assumes for tools (0: this host's)")
    e.add_argument("--min-tool-cpu", type=float, default=0.05,
                   help="tool phases shorter than this (s) are waits, not a CPU-burning process")
    e.add_argument("--kv-events", action="store_true",
                   help="emulated workers publish KV events (--kv-events-config) and the proxy"
                   " subscribes to them (prefix placement, resident-block fit, retention)")
    e.add_argument("--no-tool-events", action="store_true",
                   help="agents do not report tool_start/tool_end; the proxy infers them")
    e.add_argument("--plain-clients", action="store_true",
                   help="agents send nothing special (a plain OpenAI client): no session id,"
                   " no final flag, no tool events; the proxy finds sessions from their"
                   " conversations, infers tool phases and ends each session on its answer"
                   " (agents call tools: tool_choice \"required\" on every call but the"
                   " last), or when idle (--text-agents)")
    e.add_argument("--text-agents", action="store_true",
                   help="with --plain-clients: agents act in text (no tools in their requests),"
                   " so no reply tells the proxy that a task is done")
    e.add_argument("--state-every", type=float, default=1.0, metavar="S",
                   help="read each proxy's /mars/v1/state every S seconds into"
                   " logs/state-*.jsonl (0: never)")
    p.set_defaults(func=main)


def vllm_kv_events(values: list[str], urls: int) -> tuple[dict[str, str], ...]:
    """``--vllm-kv-events`` values as the proxy's ``workers[].kv_events`` entries."""
    if len(values) > urls:
        raise ValueError(f"--vllm-kv-events given {len(values)} times for {urls} --vllm-url")
    out = []
    for v in values:
        parts = [p.strip() for p in v.split(",")]
        if not 1 <= len(parts) <= 2 or not all(p.startswith("tcp://") for p in parts):
            raise ValueError(f"--vllm-kv-events {v!r}: expected tcp://HOST:PORT[,tcp://HOST:PORT]")
        entry = {"endpoint": parts[0], "topic": "kv"}
        if len(parts) == 2:
            entry["replay_endpoint"] = parts[1]
        out.append(entry)
    return tuple(out)


def _calibrate(urls: list[str], seed: int) -> VllmFacts:
    facts = calibrate(urls[0].rstrip("/"), seed)
    sys.stderr.write(f"real vLLM at {urls[0]}: {facts.describe()}\n")
    return facts


def main(args: argparse.Namespace) -> int:
    vllm_urls = tuple(u.rstrip("/") for u in args.vllm_url)
    for u in vllm_urls:
        if not u.startswith(("http://", "https://")):
            sys.stderr.write(f"marsproxy bench live: --vllm-url {u!r}: give it as"
                             " http://HOST:PORT\n")
            return 2
    try:
        facts = _calibrate(list(vllm_urls), args.seed) if vllm_urls else None
    except (OSError, aiohttp.ClientError, RuntimeError, KeyError, ValueError) as exc:
        sys.stderr.write(f"marsproxy bench live: cannot measure {vllm_urls[0]}:"
                         f" {type(exc).__name__}: {exc}\n")
        return 1
    try:
        if args.workers < 1 and not vllm_urls:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        if not args.time_scale > 0:
            raise ValueError(f"--time-scale must be > 0, got {args.time_scale}")
        context = facts.max_model_len if facts else get_profile(
            args.profile, num_blocks=args.num_blocks,
            max_model_len=args.max_model_len).effective_max_model_len
        cases = options.cases(args, context)
        pols = options.policies(args.policies)
        sets = options.parse_sets(args.sets, options.queue_deadline(
            args, options.DEFAULT_QUEUE_DEADLINE_S))
        options.check_policies(pols, sets)
        options.check_mix(cases[0].spec.mix, sets)
        if args.state_every < 0:
            raise ValueError(f"--state-every must be >= 0, got {args.state_every}")
        traces = load_trace(args.trace, held_out=args.held_out)  # a bad one fails here
        setup = LiveSetup(
            profile=args.profile, time_scale=args.time_scale, workers=args.workers,
            num_blocks=args.num_blocks, max_model_len=args.max_model_len, vllm_urls=vllm_urls,
            vllm_priority={"true": True, "false": False}.get(args.vllm_priority, "auto"),
            vllm=facts,
            tool_cpus=args.tool_cpus, report_tools=not (args.no_tool_events or args.plain_clients),
            plain_clients=args.plain_clients,
            # A real vLLM forces a tool call only with a tool parser, and the random test
            # models never close one: there, plain agents act in text.
            tool_calls=args.plain_clients and not args.text_agents and not vllm_urls,
            kv_events=args.kv_events,
            vllm_kv_events=vllm_kv_events(args.vllm_kv_events, len(vllm_urls)),
            min_tool_cpu_s=args.min_tool_cpu, state_every_s=args.state_every,
            system_prompt_tokens=max(1, round(600 * args.token_scale)), sets=sets,
            # A call may wait out the queue deadline, then run: the agent waits for both.
            request_timeout_s=float(sets["admission"]["queue_deadline_s"]) + CALL_TIMEOUT_S)
        setup.engine_profile()
    except ValueError as exc:
        sys.stderr.write(f"marsproxy bench live: {exc}\n")
        return 2
    out = options.out_dir(args.out, "live")
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results: list[RunResult] = []
    for case in cases:
        wl = build_workload(traces, case.spec)
        for policy in pols:
            res = run_policy(wl, policy, setup, logs, sys.stderr, case.label)
            res.regime, res.load, res.seed = case.regime, case.load, case.seed
            res.extra["workload"] = wl.describe()
            results.append(res)
    meta: dict[str, Any] = {
        "kind": "live", "backend": ", ".join(setup.vllm_urls) or
        f"{args.workers} emulated worker(s), profile {args.profile}, time scale {args.time_scale}",
        "max_model_len": context,
        "host CPUs": os.cpu_count(), "tool_cpus (proxy)": args.tool_cpus or "host",
        "trace": options.trace_label(args), "sessions": args.sessions,
        "seed": options.seeds_text(args),
        "arrivals": args.arrivals, "token_scale": args.token_scale,
        "tool_time_scale": args.tool_time_scale, "max_turns": args.max_turns,
        "overrides": sets,
        "agents report tool events": setup.report_tools,
        "agents send session ids and final flags": not setup.plain_clients,
        "agents act through tool calls": setup.tool_calls,
        "kv_events": args.kv_events or bool(args.vllm_kv_events),
        "prefix_groups": args.prefix_groups,
        "queue deadline": options.deadline_meta(sets, options.DEFAULT_QUEUE_DEADLINE_S,
                                                "a day, longer than the run"),
        "agent call timeout_s": setup.request_timeout_s,
        "tool phases": f"CPU-burning processes from {args.min_tool_cpu} s, waits below",
        "ideal": "computed from the engine profile and the tool times",
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if facts is not None:
        resets = [v for r in results for v in r.extra.get("prefix_cache_reset", [])]
        meta.update({
            "real vLLM": facts.describe(),
            "workers[].priority (proxy)": setup.vllm_priority,
            "ideal": "computed from the tool times and the server's speed measured idle"
            " (per call: fixed cost + uncached prompt / prefill speed + output / decode speed)",
            "prefix cache between policies": "emptied (POST /reset_prefix_cache)"
            if resets and all(v is True for v in resets) else
            f"NOT reliably emptied (answers {resets}; serve with VLLM_SERVER_DEV_MODE=1)",
        })
    meta["load average (1 min) per run, start→end"] = ", ".join(
        f"{r.regime} {r.case_load} {r.policy} {r.extra['loadavg_start'][0]}→"
        f"{r.extra['loadavg_end'][0]}" for r in results)
    path = report.write(out, results, "marsproxy bench live", meta, make_plots=not args.no_plots)
    sys.stderr.writelines(line + "\n" for line in report.summary_lines(results))
    sys.stdout.write(f"{path}\n")
    return 0
