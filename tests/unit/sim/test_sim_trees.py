"""Agent trees in the simulator: the workload's shape, parents that wait on their children,
and the tree completion time the report shows."""

from __future__ import annotations

import random

import pytest

from marsproxy.emulator.profiles import get_profile
from marsproxy.runs import options
from marsproxy.runs.arrivals import ArrivalSpec
from marsproxy.runs.report import tree_table
from marsproxy.runs.trace import load_trace
from marsproxy.runs.trees import grow_trees
from marsproxy.runs.workload import Workload, WorkloadSpec, build_workload
from marsproxy.sim.harness import SimSetup, Simulation

SETUP = SimSetup(profile=get_profile("tiny", num_blocks=384), tool_cpus=2, system_prompt_tokens=60)


def _workload(sessions: int = 16) -> Workload:
    return build_workload(load_trace(), WorkloadSpec(
        sessions=sessions, seed=1, token_scale=0.1, tool_time_scale=0.05, max_turns=6,
        max_context_tokens=5000, arrivals=ArrivalSpec("poisson", 1.0), trees=(2, 4)))


def test_trees_are_built_deterministically_from_the_flat_sessions() -> None:
    wl = _workload()
    assert wl == _workload()
    roots = [s for s in wl.sessions if s.children]
    by_id = {s.id: s for s in wl.sessions}
    assert roots and len(wl.sessions) == 16
    for r in roots:
        assert 1 <= len(r.children) <= 4  # 2 to 4, fewer only for the last tree
        assert 0 <= r.spawn_at < len(r.turns) - 1  # a tool phase, never after the last call
        assert all(by_id[c].parent == r.id for c in r.children)
    with pytest.raises(ValueError):
        grow_trees(wl.sessions, (3, 2), random.Random(0))


def test_a_parent_goes_on_only_after_its_children_and_the_report_says_so() -> None:
    wl = _workload()
    runs = {}
    for policy in ("mars", "mars-no-trees"):
        cfg = options.proxy_config(policy, options.parse_sets([]), ["http://w0"])
        runs[policy] = res = Simulation(wl, policy, SETUP, cfg).run()
        assert all(o.ok for o in res.outcomes)
        out = {o.id: o for o in res.outcomes}
        for s in wl.sessions:
            if not s.children:
                continue
            root = out[s.id]
            assert root.end_s is not None
            # The call after the spawn starts once every child has ended.
            resumed = root.turns[s.spawn_at + 1].sent_s
            assert all(resumed >= (out[c].end_s or 0) for c in s.children)
            assert all(out[c].arrival_s == root.turns[s.spawn_at].sent_s
                       + root.turns[s.spawn_at].latency_s for c in s.children)
    summaries = {p: r.summary() for p, r in runs.items()}
    roots = sum(1 for s in wl.sessions if s.children)
    assert all(s.trees == roots and s.tree_completion == 1.0 for s in summaries.values())
    lines = tree_table(summaries)
    assert any(line.startswith("| mars | ") and "(100.0 % vs 100.0 %)" in line for line in lines)
