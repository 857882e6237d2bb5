"""``marsproxy sim --sweep N``: the admission plane's invariants on N seeded random workloads.

Workload ``seed`` (``--seed S`` runs S, S+1, ..., S+N-1; ``--sweep 1 --seed K`` repeats
workload K alone) draws, each from its own seeded RNG:

- sessions: synthesised (turns, first prompt, prompt growth, output sizes, tool times; one-call
  sessions among them) or sampled from the packaged trace, scaled to fit the cache;
- arrivals: Poisson, bursts, or one at a time (each session after the previous one's ideal
  time);
- clients: with or without the final flag (without: the proxy ends sessions on their answers
  where the agents call tools, else by idle timeout; which of the two, from an RNG of its own),
  reporting tool phases or leaving them to be inferred;
- the cache: the ``tiny`` profile with 256 to 16384 KV blocks, or the H200 profile; 1 to 4
  workers; 1 to 16 tool CPUs; engines that schedule by priority, or FCFS behind the proxy's
  dispatch gate (the default ``workers[].priority: false``);
- with several workers, half the time KV events (the proxy's KV indexes, prefix placement) and
  sessions in 2 or 8 groups sharing a tenth to a third of the context as their first prompt's
  start (drawn from an RNG of their own, so the draws above are the same as without them).

Each workload runs under ``mars`` with the config ``marsproxy sim`` uses by default and under
``direct``; :mod:`marsproxy.sim.invariants` checks (a)–(d). Deterministic: the same seeds print
the same lines.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

from marsproxy.aimd.admission import AdmissionCore
from marsproxy.config import MarsConfig
from marsproxy.emulator.profiles import EngineProfile, get_profile
from marsproxy.runs import options
from marsproxy.runs.arrivals import ArrivalSpec
from marsproxy.runs.ideal import ideal_seconds
from marsproxy.runs.trace import SessionTrace, Turn, load_trace
from marsproxy.runs.workload import PlannedSession, Workload, WorkloadSpec, build_workload
from marsproxy.sim.harness import SimSetup, Simulation
from marsproxy.sim.invariants import (
    LightLoad,
    Violation,
    check_drained,
    check_outcomes,
    check_tick,
    light_load,
    light_load_violations,
)

LIGHT_LOAD_TOLERANCE = 0.03
_POLICY = "mars"
_TINY_BLOCKS = (256, 384, 512, 1024, 2048, 4096, 16384)
_H200 = "h200-qwen3-coder-30b-a3b"
_TOOLS = ("read", "edit", "search", "test", "bash", "git")
_SHOWN = 4  # violations printed per workload (all are counted)


@dataclass(frozen=True, slots=True)
class SweepCase:
    seed: int
    workload: Workload
    setup: SimSetup
    label: str


@dataclass(slots=True)
class CaseResult:
    case: SweepCase
    violations: list[Violation] = field(default_factory=list)
    light: LightLoad | None = None
    """The proxy against ``direct``, where ``direct`` saw no overload."""
    versus: LightLoad | None = None
    """The proxy against ``direct`` on any load (the sessions both finished)."""
    refused: int = 0
    waiting_ticks: int = 0
    """Control ticks after which a session waited (where (a) had something to check)."""


def _profile(rng: random.Random) -> EngineProfile:
    if rng.random() < 0.2:
        return get_profile(_H200)
    return get_profile("tiny", num_blocks=rng.choice(_TINY_BLOCKS))


def _synthetic(rng: random.Random, n: int, context: int) -> list[SessionTrace]:
    """``n`` made-up sessions: prompts that start at 2–70 % of ``context`` and grow each turn."""
    one_call = rng.random() < 0.25  # a batch of one-shot tasks, as a plain client sends
    tool_mean = rng.choice((0.05, 0.5, 2.0, 8.0))
    share = rng.choice((0.1, 0.4, 0.7))  # of the context, the largest first prompt
    out = []
    for i in range(n):
        turns = 1 if one_call else rng.randint(1, 10)
        prompt = max(16, round(context * rng.uniform(0.02, share)))
        growth = max(1, round(context * rng.uniform(0.0, 0.08)))
        rows = []
        for t in range(turns):
            last = t == turns - 1
            rows.append(Turn(input_tokens=prompt, output_tokens=rng.randint(1, 160),
                             tool_s=None if last else rng.expovariate(1 / tool_mean),
                             tool=rng.choice(_TOOLS)))
            prompt += rng.randint(1, growth)
        out.append(SessionTrace(f"syn{i}", tuple(rows)))
    return out


def _arrivals(rng: random.Random) -> ArrivalSpec:
    kind = rng.choice(("poisson", "burst", "fixed"))
    if kind == "poisson":
        return ArrivalSpec("poisson", rng.choice((0.02, 0.1, 0.5, 2.0, 5.0, 0.0)))
    if kind == "burst":
        return ArrivalSpec("burst", rng.choice((0.01, 0.05, 0.2)), rng.randint(2, 10))
    return ArrivalSpec("fixed", 1.0)  # one at a time: spaced out in make_case


def make_case(seed: int, traces: Sequence[SessionTrace]) -> SweepCase:
    """Workload ``seed`` of the sweep, with its system."""
    rng = random.Random(f"sweep:{seed}")
    profile = _profile(rng)
    workers = rng.randint(1, 4)
    sessions = rng.randint(2, 64)
    # Room for the reply and the shared system prompt: every prompt fits one worker.
    system = 60 if profile.num_blocks < 4096 else 600
    context = max(64, min(profile.effective_max_model_len, 65_536) - 200 - system)
    synthetic = rng.random() < 0.5
    source = _synthetic(rng, sessions, context) if synthetic else list(traces)
    arrivals = _arrivals(rng)
    kv = random.Random(f"sweep-kv:{seed}")
    kv_events = workers > 1 and kv.random() < 0.5
    groups = kv.choice((0, 2, 8)) if kv_events else 0
    spec = WorkloadSpec(
        sessions=sessions, seed=seed, max_context_tokens=context,
        token_scale=1.0 if synthetic else rng.choice((0.02, 0.05, 0.1, 0.25)),
        tool_time_scale=1.0 if synthetic else rng.choice((0.01, 0.1, 0.5)),
        max_turns=None if synthetic else rng.randint(1, 12), arrivals=arrivals,
        prefix_groups=groups, prefix_tokens=max(1, round(context * kv.uniform(0.1, 0.33))),
    )
    wl = _fitting(source, spec, profile.effective_max_model_len, system)
    if arrivals.kind == "fixed":
        longest = max(sum(ideal_seconds(s, profile)) for s in wl.sessions)
        spec = dataclasses.replace(spec, arrivals=ArrivalSpec("fixed", 1 / (1.5 * longest + 0.5)))
        wl = _fitting(source, spec, profile.effective_max_model_len, system)
    setup = SimSetup(
        profile=profile, workers=workers, tool_cpus=float(rng.choice((1, 2, 4, 16))),
        system_prompt_tokens=system, report_tools=rng.random() < 0.5,
        send_final=rng.random() < 0.6, horizon_s=100_000.0,
        worker_mode=rng.choice(("priority", "gated")),  # gated: FCFS engines (the default)
        kv_events=kv_events,
        # Its own draw, so the workloads drawn before it stayed what they were.
        tool_calls=random.Random(f"sweep-calls:{seed}").random() < 0.5,
    )
    kind = "one at a time" if arrivals.kind == "fixed" else spec.arrivals.label()
    label = (f"{workers}x {profile.name} {profile.num_blocks} blocks,"
             f" {'synthetic' if synthetic else 'sampled'} {sessions} sessions, {kind},"
             f" {setup.tool_cpus:g} tool CPUs, {'final flag' if setup.send_final else 'no final'},"
             f" {'tool-calling' if setup.tool_calls else 'text'} agents,"
             f" {'reported' if setup.report_tools else 'inferred'} tools,"
             f" {'FCFS' if setup.worker_mode == 'gated' else 'priority'} engines"
             + (f", KV events, {groups} prefix groups" if kv_events else ""))
    return SweepCase(seed, wl, setup, label)


def _fitting(source: Sequence[SessionTrace], spec: WorkloadSpec, limit: int,
             system: int) -> Workload:
    """The workload, its prompts capped lower until every call fits the engine's context:
    replayed prompts also carry every reply and the system prompt."""
    while True:
        wl = build_workload(source, spec)
        over = max(_longest_call(s, system) for s in wl.sessions) - limit
        if over <= 0 or spec.max_context_tokens <= 64:
            return wl
        cap = max(64, spec.max_context_tokens - over)  # a shared prefix stays below it
        spec = dataclasses.replace(spec, max_context_tokens=cap,
                                   prefix_tokens=min(spec.prefix_tokens, cap - 1))


def _longest_call(plan: PlannedSession, system: int) -> int:
    # As the harness builds prompts: at least the planned size, and each one the previous
    # prompt, its reply and one new token.
    prompt, longest = system + 1, 0
    for t in plan.turns:
        prompt = max(prompt, t.input_tokens)
        longest = max(longest, prompt + t.output_tokens)
        prompt += t.output_tokens + 1
    return longest


def swept_config(sets: Sequence[str], workers: Sequence[str] = ("http://w0",)) -> MarsConfig:
    """The swept policy's config with ``sets`` over it (a ``ValueError`` names a bad item)."""
    return options.proxy_config(_POLICY, options.parse_sets(list(sets)), list(workers))


def run_case(case: SweepCase, sets: Sequence[str] = ()) -> CaseResult:
    """``mars`` (its config with ``sets``, ``--set`` items, over it) with the invariants checked
    at every control tick and at the end, then ``direct`` on the same workload for (c)."""
    cfg = swept_config(sets, [f"http://w{i}" for i in range(case.setup.workers)])
    out = CaseResult(case)

    def on_tick(now: float, core: AdmissionCore) -> None:
        out.waiting_ticks += 1 if len(core.queue) else 0
        out.violations.extend(check_tick(now, core))

    sim = Simulation(case.workload, _POLICY, case.setup, cfg, on_tick=on_tick)
    mine = sim.run()
    out.violations += check_outcomes(mine)
    out.violations += check_drained(sim.core, sim.sched, sim.leftovers(),
                                    float(mine.extra["sim_end_s"]))
    out.refused = sum(1 for o in mine.outcomes if o.rejected)
    direct = Simulation(case.workload, options.DIRECT, case.setup, None).run()
    out.versus = light_load(direct, mine)
    stats = direct.extra["stats"]
    tool_cores = case.setup.tool_cpus - case.setup.busy_cpus
    if stats["preemptions"] == 0 and stats["max_tools"] <= tool_cores and all(
            o.ok for o in direct.outcomes):
        out.light = out.versus
        out.violations += light_load_violations(out.versus, mine.policy, LIGHT_LOAD_TOLERANCE)
    return out


def sweep(n: int, first_seed: int, out: TextIO, sets: Sequence[str] = ()) -> int:
    """Run workloads ``first_seed`` .. ``first_seed + n - 1``; print each one's violations and
    a summary. Returns the number of violations. ``sets``: ``--set`` items over the config."""
    traces = load_trace(None)
    config = "default config of marsproxy sim" + "".join(f", {s}" for s in sets)
    out.write(f"marsproxy sim --sweep {n} --seed {first_seed}: policy {_POLICY} ({config})"
              " against direct\n")
    results = []
    for seed in range(first_seed, first_seed + n):
        r = run_case(make_case(seed, traces), sets)
        results.append(r)
        if r.violations:
            out.write(f"seed {seed}: {r.case.label}: {len(r.violations)} violations\n")
            for v in r.violations[:_SHOWN]:
                out.write(f"  {v}\n")
            if len(r.violations) > _SHOWN:
                out.write(f"  ... {len(r.violations) - _SHOWN} more\n")
        out.flush()
    out.write(summary(results))
    return sum(len(r.violations) for r in results)


def summary(results: Sequence[CaseResult]) -> str:
    """Counts by invariant, workloads with violations, and the worst light-load ratio."""
    by_rule = {k: 0 for k in "abcd"}
    for r in results:
        for v in r.violations:
            by_rule[v.rule] += 1
    bad = [r.case.seed for r in results if r.violations]
    sessions = sum(len(r.case.workload.sessions) for r in results)
    refused = sum(r.refused for r in results)
    waits = sum(r.waiting_ticks for r in results)
    lines = [f"workloads: {len(results)}, sessions: {sessions}, refused (documented): {refused},"
             f" control ticks with a session waiting: {waits}"]
    light = [r for r in results if r.light is not None]
    if light:
        worst = max(light, key=lambda r: r.light.worst if r.light else 0.0)
        assert worst.light is not None
        lines.append(
            f"light load: {len(light)} workloads; worst ratio to direct {worst.light.worst:.4f}x"
            f" (seed {worst.case.seed}: mean {worst.light.mean_ratio:.4f}x, P95"
            f" {worst.light.p95_ratio:.4f}x; bound {1 + LIGHT_LOAD_TOLERANCE:.2f}x)")
    else:
        lines.append("light load: no workload")
    lines.append(_versus(results))
    total = sum(by_rule.values())
    counts = ", ".join(f"{k}: {v}" for k, v in by_rule.items())
    lines.append(f"violations: {total} ({counts})"
                 + (f" in workloads {', '.join(map(str, bad))}" if bad else ""))
    return "\n".join(lines) + "\n"


def _versus(results: Sequence[CaseResult]) -> str:
    """Every workload's mean E2E under the proxy over ``direct``'s: where it is worse."""
    pairs = sorted(((r.versus, r.case) for r in results if r.versus is not None),
                   key=lambda p: p[0].mean_ratio)
    if not pairs:
        return "all loads: no workload"
    worse = [c for v, c in pairs if v.mean_ratio > 1 + LIGHT_LOAD_TOLERANCE]
    plain = sum(1 for c in worse if not c.setup.send_final)
    missing = sum(v.unfinished for v, _ in pairs)
    (best, _), (mid, _), (worst, case) = pairs[0], pairs[len(pairs) // 2], pairs[-1]
    return (f"all loads: mean E2E over direct's: median {mid.mean_ratio:.3f}x,"
            f" best {best.mean_ratio:.3f}x, worst {worst.mean_ratio:.3f}x (seed {case.seed}:"
            f" {case.label}); above {1 + LIGHT_LOAD_TOLERANCE:.2f}x: {len(worse)} of"
            f" {len(pairs)} ({plain} without the final flag); sessions direct finished and the"
            f" proxy did not: {missing}")
