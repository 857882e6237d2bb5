"""``marsproxy sim``: every policy on every (regime, load) workload, in virtual time; writes the
same results.json / report.md / plots as ``marsproxy bench live``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from marsproxy.emulator.profiles import get_profile, profile_names
from marsproxy.runs import options, report
from marsproxy.runs.progress import Progress
from marsproxy.runs.results import RunResult, write_log
from marsproxy.runs.trace import SessionTrace, load_trace
from marsproxy.runs.workload import build_workload
from marsproxy.sim.harness import SimSetup, Simulation
from marsproxy.sim.sweep import sweep, swept_config


@dataclass(frozen=True, slots=True)
class SimRun:
    cases: list[options.Case]
    policies: list[str]
    setup: SimSetup
    sets: dict[str, object]


def run_cases(
    run: SimRun, traces: list[SessionTrace], out: TextIO | None = None,
    on_case: Callable[[list[RunResult]], None] | None = None, logs: Path | None = None,
) -> list[RunResult]:
    """Every policy on every case; ``on_case`` gets the results so far after each case (a
    long matrix keeps what it has if it is stopped); each run's state snapshots (with
    ``setup.state_every_s``) go to ``logs``."""
    results: list[RunResult] = []
    workers = [f"http://w{i}" for i in range(run.setup.workers)]
    for case in run.cases:
        wl = build_workload(traces, case.spec)
        for policy in run.policies:
            cfg = None if policy == options.DIRECT else options.proxy_config(
                policy, dict(run.sets), workers)
            bar = Progress(f"{case.label} {policy}", len(wl.sessions), out)
            t0 = time.perf_counter()
            sim = Simulation(wl, policy, run.setup, cfg, progress=bar.update)
            res = sim.run()
            bar.close(report.done_note(res))
            if logs is not None:
                write_log(logs, "state", case.label, policy, sim.states)
            res.regime, res.load, res.seed = case.regime, case.load, case.seed
            res.extra["cpu_s"] = round(time.perf_counter() - t0, 2)
            res.extra["workload"] = wl.describe()
            results.append(res)
        if on_case is not None:
            on_case(results)
    return results


def configure_parser(p: argparse.ArgumentParser) -> None:
    options.add_workload_args(p, sessions=300, rates="0.05,0.2,0.5", token_scale=1.0,
                              tool_time_scale=1.0, max_turns=None, regimes="8k,32k,64k,128k",
                              queue_deadline="the --horizon")
    options.add_mix_args(p)
    e = p.add_argument_group("system")
    e.add_argument("--profile", default="h200-qwen3-coder-30b-a3b", choices=profile_names())
    e.add_argument("--workers", type=int, default=1, help="emulated engines")
    e.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: profile)")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="the longest context an engine serves, as vLLM's (default: profile)")
    e.add_argument("--time-scale", type=float, default=1.0,
                   help="seconds per modelled engine second (mirror a live run's emulators)")
    e.add_argument("--tool-cpus", type=float, default=16.0, help="cores shared by tools (K)")
    e.add_argument("--busy-cpus", type=float, default=0.0,
                   help="of those K cores, the share other work takes (the engine's host"
                   " process, the proxy, the agents): tools get K minus this, the proxy counts"
                   " K (a live run on a 2-core host: about 0.4)")
    e.add_argument("--call-overhead", type=float, default=0.0, metavar="S",
                   help="seconds each call after the first spends between the end of the tool"
                   " phase and the proxy (agent, HTTP, proxy), holding its slot (a live run on"
                   " a busy 2-core host: about 0.01)")
    e.add_argument("--state-every", type=float, default=0.0, metavar="S",
                   help="virtual seconds between state snapshots of the admission core and"
                   " the engines, in logs/state-*.jsonl as `bench live` writes them (0: none;"
                   " about 2 kB each: 300 sessions at 32k, heavy, every 1 s: 5 MB per policy)")
    e.add_argument("--horizon", type=float, default=1e7,
                   help="stop at this virtual time (s); sessions not done by then count as failed,"
                   " at the horizon")
    e.add_argument("--worker-mode", choices=("priority", "gated"), default="priority",
                   help="engines schedule by the body priority, or FCFS behind the proxy's"
                   " dispatch gate")
    e.add_argument("--infer-tools", action="store_true",
                   help="agents do not report tool events; the proxy infers tool phases")
    e.add_argument("--plain-clients", action="store_true",
                   help="agents send nothing special (a plain OpenAI client): no final flag,"
                   " no tool events; the proxy infers tool phases and ends each session on"
                   " its answer (a reply that calls no tool), or when idle (--text-agents)")
    e.add_argument("--text-agents", action="store_true",
                   help="agents act in text (Aider, SWE-agent): no reply calls a tool, so no"
                   " reply tells the proxy that a task is done")
    e.add_argument("--kv-events", action="store_true",
                   help="workers publish KV events: the proxy places new sessions by resident"
                   " prefix (placement.policy), budgets admission by resident blocks and"
                   " verifies retention, as with vLLM's --kv-events-config")
    k = p.add_argument_group("invariants")
    k.add_argument("--sweep", type=int, default=None, metavar="N",
                   help="instead of the workloads above: check the admission invariants"
                   " (docs/admission.md) on N seeded random workloads, seeds --seed .."
                   " --seed+N-1, the --set items over mars' config; exit status 1 on any"
                   " violation")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.sweep is not None:
        if args.sweep < 1:
            sys.stderr.write(f"marsproxy sim: --sweep needs N >= 1, got {args.sweep}\n")
            return 2
        try:
            swept_config(args.sets)  # a bad --set fails here, not in the first workload
        except ValueError as exc:
            sys.stderr.write(f"marsproxy sim: {exc}\n")
            return 2
        return 1 if sweep(args.sweep, args.seed, sys.stdout, args.sets) else 0
    try:
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        for flag, v in (("--time-scale", args.time_scale), ("--horizon", args.horizon)):
            if not v > 0:
                raise ValueError(f"{flag} must be > 0, got {v}")
        profile = get_profile(args.profile, num_blocks=args.num_blocks,
                              max_model_len=args.max_model_len)
        cases = options.cases(args, profile.effective_max_model_len)
        pols = options.policies(args.policies)
        sets = options.parse_sets(args.sets, options.queue_deadline(args, args.horizon))
        options.check_policies(pols, sets)
        options.check_mix(cases[0].spec.mix, sets)
        if not 0 <= args.busy_cpus < args.tool_cpus:
            raise ValueError(f"--busy-cpus must be >= 0 and below --tool-cpus"
                             f" ({args.tool_cpus}), got {args.busy_cpus}")
        if args.call_overhead < 0:
            raise ValueError(f"--call-overhead must be >= 0, got {args.call_overhead}")
        if args.state_every < 0:
            raise ValueError(f"--state-every must be >= 0, got {args.state_every}")
        traces = load_trace(args.trace, held_out=args.held_out)
    except ValueError as exc:
        sys.stderr.write(f"marsproxy sim: {exc}\n")
        return 2
    setup = SimSetup(profile=profile, workers=args.workers, tool_cpus=args.tool_cpus,
                     busy_cpus=args.busy_cpus,
                     system_prompt_tokens=max(1, round(600 * args.token_scale)),
                     report_tools=not (args.infer_tools or args.plain_clients),
                     send_final=not args.plain_clients, tool_calls=not args.text_agents,
                     worker_mode=args.worker_mode,
                     time_scale=args.time_scale, call_overhead_s=args.call_overhead,
                     state_every_s=args.state_every, kv_events=args.kv_events,
                     horizon_s=args.horizon)
    run = SimRun(cases, pols, setup, sets)
    t0 = time.perf_counter()
    out = options.out_dir(args.out, "sim")

    def meta() -> dict[str, object]:
        return {
            "kind": "simulation (virtual time)", "profile": profile.name,
            "workers": args.workers, "worker_mode": args.worker_mode,
            "time_scale": args.time_scale,
            "kv_blocks": profile.num_blocks, "max_model_len": profile.effective_max_model_len,
            "tool_cpus": args.tool_cpus,
            "busy_cpus": args.busy_cpus, "call_overhead_s": args.call_overhead,
            "state_every_s": args.state_every,
            "trace": options.trace_label(args),
            "sessions": args.sessions if not cases[0].spec.mix else "by group",
            "seed": options.seeds_text(args),
            "arrivals": args.arrivals, "token_scale": args.token_scale,
            "tool_time_scale": args.tool_time_scale, "max_turns": args.max_turns,
            "overrides": sets,
            "agents report tool events": setup.report_tools,
            "agents flag their last call final": setup.send_final,
            "agents act through tool calls": setup.tool_calls,
            "kv_events": args.kv_events, "prefix_groups": args.prefix_groups,
            "prefix_tokens": args.prefix_tokens,
            "horizon_s": args.horizon,
            "queue deadline": options.deadline_meta(sets, args.horizon, "the horizon"),
            "wall_s": round(time.perf_counter() - t0, 1),
        }

    def partial(results: list[RunResult]) -> None:
        report.write(out, results, "marsproxy sim (partial)", meta(), make_plots=False)

    logs = None
    if args.state_every > 0:
        logs = out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
    results = run_cases(run, traces, sys.stderr, partial, logs)
    path = report.write(out, results, "marsproxy sim", meta(), make_plots=not args.no_plots)
    sys.stderr.writelines(line + "\n" for line in report.summary_lines(results))
    sys.stdout.write(f"{path}\n")
    return 0
