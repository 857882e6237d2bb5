"""Service classes and tenant shares, alone vs mixed (simulator; prints numbers, not a test).

    .venv/bin/python benchmarks/sharing_bench.py [--seeds 0,1,2] [--set KEY=VALUE ...]

By default seeds 0 to 11 (about a minute).

Issue 23's goals, each measured side by side in one run, on the same sessions (a group's
sessions are the same alone and in the mix, ``marsproxy/runs/mix.py``), per seed and as the
mean over the seeds:

(a) 4 interactive sessions among a 64-session batch sweep on one KV-bound worker (the
    ``tiny`` profile with 384 KV blocks, the KV-bound workload of docs/results.md):
    interactive mean E2E within 1.2x of the same 4 alone; batch throughput >= 80 % of the
    batch sweep alone.
(b) two tenants at 10:1 load (4 sessions at 0.4/s vs 40 at 4/s), equal weights: the light
    tenant's mean E2E within 1.3x of the light tenant alone. For comparison in the same run,
    the same mix under the ``fcfs`` preset and under mars with both groups sent as one tenant
    (no tenant ordering), and what the heavy tenant keeps of the throughput it had as one
    tenant. A check that tenants cost nothing when their loads are equal: two tenants at
    2/s each (32 sessions each), the mean E2E of all against the same sessions as one tenant.

Every ratio is printed with the completions of both runs it compares (``done a/b``). For the
interactive sessions it also splits the E2E into the first call (admission wait included)
and the later calls (engine time once admitted), to show where a slowdown comes from.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Sequence

from marsproxy.emulator.profiles import get_profile
from marsproxy.runs import options
from marsproxy.runs.arrivals import ArrivalSpec
from marsproxy.runs.mix import MixGroup, parse_mix
from marsproxy.runs.results import RunResult, Summary, group_summaries
from marsproxy.runs.trace import load_trace
from marsproxy.runs.workload import Workload, WorkloadSpec, build_workload
from marsproxy.sim.harness import SimSetup, Simulation

# The KV-bound workload of docs/results.md (one worker, 384 blocks of the tiny profile).
PROFILE, BLOCKS = "tiny", 384
CLASSES_MIX = "interactive:4@0.5,batch:64@4"
TENANTS_MIX = "light:4@0.4,heavy:40@4"
EQUAL_MIX = "a:32@2,b:32@2"


def _spec(seed: int, groups: tuple[MixGroup, ...], max_context: int) -> WorkloadSpec:
    return WorkloadSpec(sessions=1, seed=seed, token_scale=0.1, tool_time_scale=0.01,
                        max_turns=8, max_context_tokens=max_context,
                        arrivals=ArrivalSpec("poisson", 1.0), mix=groups)


def _run(wl: Workload, policy: str, sets: list[str]) -> RunResult:
    setup = SimSetup(profile=get_profile(PROFILE, num_blocks=BLOCKS), workers=1, tool_cpus=2,
                     busy_cpus=0.4, system_prompt_tokens=60, time_scale=2.0,
                     call_overhead_s=0.01)
    cfg = options.proxy_config(policy, options.parse_sets(sets), ["http://w0"])
    return Simulation(wl, policy, setup, cfg).run()


def _group(run: RunResult, name: str) -> Summary:
    return group_summaries(run.outcomes)[name]


def _split(run: RunResult, name: str) -> tuple[float, float]:
    """Mean over the group's sessions of (first call, later calls) seconds."""
    own = [o for o in run.outcomes if o.group == name and o.turns]
    first = statistics.mean(o.turns[0].latency_s for o in own)
    later = statistics.mean(sum(t.latency_s for t in o.turns[1:]) for o in own)
    return first, later


def _done(s: Summary) -> str:
    return f"{s.finished}/{s.sessions}"


def classes(seed: int, sets: list[str], max_context: int) -> dict[str, float]:
    groups = parse_mix(CLASSES_MIX, "class")
    mixed = _run(build_workload(load_trace(None), _spec(seed, groups, max_context)), "mars",
                 sets)
    alone = {g.name: _run(build_workload(load_trace(None), _spec(seed, (g,), max_context)),
                          "mars", sets) for g in groups}
    i_mix, i_alone = _group(mixed, "interactive"), _group(alone["interactive"], "interactive")
    b_mix, b_alone = _group(mixed, "batch"), _group(alone["batch"], "batch")
    e2e = i_mix.mean_s / i_alone.mean_s
    thr = b_mix.throughput_per_s / b_alone.throughput_per_s
    (f_a, l_a), (f_m, l_m) = _split(alone["interactive"], "interactive"), _split(
        mixed, "interactive")
    print(f"(a) seed {seed}: interactive mean {i_mix.mean_s:.2f} s mixed vs {i_alone.mean_s:.2f}"
          f" alone: {e2e:.2f}x (done {_done(i_mix)} vs {_done(i_alone)}; first call"
          f" {f_m:.2f} vs {f_a:.2f} s, later calls {l_m:.2f} vs {l_a:.2f} s); batch throughput"
          f" {b_mix.throughput_per_s:.3f}/s vs {b_alone.throughput_per_s:.3f}/s alone:"
          f" {100 * thr:.0f} % (done {_done(b_mix)} vs {_done(b_alone)})")
    return {"interactive_x": e2e, "batch_pct": 100 * thr,
            "done": min(i_mix.completion, i_alone.completion, b_mix.completion,
                        b_alone.completion)}


def tenants(seed: int, sets: list[str], max_context: int) -> dict[str, float]:
    groups = parse_mix(TENANTS_MIX, "tenant")
    wl = build_workload(load_trace(None), _spec(seed, groups, max_context))
    one = Workload(wl.spec, tuple(dataclasses.replace(s, tenant="") for s in wl.sessions))
    alone = _group(_run(build_workload(load_trace(None), _spec(seed, groups[:1], max_context)),
                        "mars", sets), "light")
    out: dict[str, float] = {}
    parts = []
    heavy = {}
    for name, w, pol in (("mars", wl, "mars"), ("mars_one_tenant", one, "mars"),
                         ("fcfs", wl, "fcfs")):
        run = _run(w, pol, sets)
        s = _group(run, "light")
        heavy[name] = _group(run, "heavy")
        out[name] = s.mean_s / alone.mean_s
        out[name + "_done"] = min(s.completion, alone.completion)
        parts.append(f"{name} {s.mean_s:.2f} s: {out[name]:.2f}x (done {_done(s)} vs"
                     f" {_done(alone)})")
    h, h1 = heavy["mars"], heavy["mars_one_tenant"]
    out["heavy_pct"] = 100 * h.throughput_per_s / h1.throughput_per_s
    out["heavy_done"] = min(h.completion, h1.completion)
    eq = build_workload(load_trace(None), _spec(seed, parse_mix(EQUAL_MIX, "tenant"),
                                                max_context))
    both = _run(eq, "mars", sets).summary()
    as_one = _run(Workload(eq.spec, tuple(dataclasses.replace(s, tenant="")
                                          for s in eq.sessions)), "mars", sets).summary()
    out["equal_x"] = both.mean_s / as_one.mean_s
    out["equal_done"] = min(both.completion, as_one.completion)
    print(f"(b) seed {seed}: light tenant alone {alone.mean_s:.2f} s; mixed " + "; ".join(parts)
          + f"; heavy throughput {out['heavy_pct']:.0f} % of one tenant's (done {_done(h)} vs"
          f" {_done(h1)}); equal tenants {out['equal_x']:.2f}x one tenant (done"
          f" {_done(both)} vs {_done(as_one)})")
    return out


def _mean(rows: Sequence[dict[str, float]], key: str) -> float:
    return statistics.mean(r[key] for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2,3,4,5,6,7,8,9,10,11", help="comma-separated seeds")
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                   help="proxy config override for every run, e.g. admission.window_max=8")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    max_context = get_profile(PROFILE, num_blocks=BLOCKS).effective_max_model_len - 1024
    a = [classes(s, args.sets, max_context) for s in seeds]
    b = [tenants(s, args.sets, max_context) for s in seeds]
    print(f"(a) mean over seeds {args.seeds}: interactive {_mean(a, 'interactive_x'):.2f}x alone"
          f" (goal <= 1.2), batch throughput {_mean(a, 'batch_pct'):.0f} % of alone (goal >= 80);"
          f" lowest completion {100 * min(r['done'] for r in a):.0f} %")
    print(f"(b) mean over seeds {args.seeds}: light tenant {_mean(b, 'mars'):.2f}x alone"
          f" (goal <= 1.3); one tenant {_mean(b, 'mars_one_tenant'):.2f}x, fcfs"
          f" {_mean(b, 'fcfs'):.2f}x; heavy tenant throughput {_mean(b, 'heavy_pct'):.0f} % of"
          f" one tenant's; equal tenants {_mean(b, 'equal_x'):.2f}x one tenant's mean; lowest"
          f" completion {100 * min(min(r[k] for k in r if k.endswith('_done')) for r in b):.0f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
