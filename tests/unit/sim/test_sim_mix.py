"""Mixed workloads in the simulator (``--classes``, ``--tenants``): the groups' sessions, the
class and tenant the plane hears, and the per-group figures of the report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from marsproxy.emulator.profiles import get_profile
from marsproxy.runs import options
from marsproxy.runs.arrivals import ArrivalSpec
from marsproxy.runs.mix import MixGroup, parse_mix
from marsproxy.runs.results import group_summaries
from marsproxy.runs.trace import load_trace
from marsproxy.runs.workload import Workload, WorkloadSpec, build_workload
from marsproxy.sim import runner
from marsproxy.sim.harness import SimSetup, Simulation

SETUP = SimSetup(profile=get_profile("tiny", num_blocks=384), tool_cpus=2, system_prompt_tokens=60)


def _workload(groups: tuple[MixGroup, ...], seed: int = 1) -> Workload:
    return build_workload(load_trace(), WorkloadSpec(
        sessions=1, seed=seed, token_scale=0.1, tool_time_scale=0.05, max_turns=4,
        max_context_tokens=5000, arrivals=ArrivalSpec("poisson", 1.0), mix=groups))


def test_parse_mix() -> None:
    groups = parse_mix("interactive:4@0.05, batch:64@0.5", "class")
    assert [(g.name, g.sessions, g.rate_per_s, g.cls, g.tenant) for g in groups] == [
        ("interactive", 4, 0.05, "interactive", ""), ("batch", 64, 0.5, "batch", "")]
    light = parse_mix("light:2@1", "tenant")[0]
    assert (light.tenant, light.cls) == ("light", None)
    for bad in ("x", "x:0@1", "x:2@-1", "a:1@1,a:2@1", ":1@1", ""):
        with pytest.raises(ValueError, match="--tenants"):
            parse_mix(bad, "tenant")


def test_a_group_has_the_same_sessions_alone_and_mixed() -> None:
    groups = parse_mix("interactive:3@0.5,batch:8@2", "class")
    mixed = _workload(groups)
    assert len(mixed.sessions) == 11
    assert [s.arrival_s for s in mixed.sessions] == sorted(s.arrival_s for s in mixed.sessions)
    for g in groups:
        alone = _workload((g,))
        mine = [s for s in mixed.sessions if s.mix == g.name]
        assert sorted(mine, key=lambda s: s.id) == sorted(alone.sessions, key=lambda s: s.id)
        assert all(s.cls == g.name and s.tenant == "" and s.id.startswith(f"{g.name}/")
                   for s in mine)
    assert _workload(groups, seed=2).sessions != mixed.sessions


def test_the_plane_hears_each_groups_tenant_and_every_session_is_counted() -> None:
    wl = _workload(parse_mix("light:3@0.5,heavy:9@2", "tenant"))
    cfg = options.proxy_config("mars", options.parse_sets([]), ["http://w0"])
    sim = Simulation(wl, "mars", SETUP, cfg, record=True)
    res = sim.run()
    assert sim.proxy is not None and sim.proxy.inputs is not None
    assert {i.args["tenant"] for i in sim.proxy.inputs if i.kind == "request"} == {
        "light", "heavy"}
    figs = group_summaries(res.outcomes)
    assert set(figs) == {"light", "heavy"}
    assert (figs["light"].sessions, figs["heavy"].sessions) == (3, 9)
    assert figs["light"].finished == 3 and figs["heavy"].finished == 9
    assert figs["light"].throughput_per_s > 0


def test_sim_command_reports_each_group(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       ) -> None:
    p = argparse.ArgumentParser()
    runner.configure_parser(p)
    out = tmp_path / "run"
    args = p.parse_args([
        "--classes", "interactive:2@1,batch:5@2", "--regimes", "trace", "--token-scale", "0.1",
        "--tool-time-scale", "0.05", "--max-turns", "3", "--profile", "tiny", "--num-blocks",
        "384", "--policies", "mars", "--no-plots", "--out", str(out)])
    assert runner.main(args) == 0
    data = json.loads((out / "results.json").read_text())
    mars = next(r for r in data["runs"] if r["policy"] == "mars")
    assert {g: s["sessions"] for g, s in mars["groups"].items()} == {"interactive": 2, "batch": 5}
    assert mars["load"] == "classes interactive:2@1, batch:5@2"
    assert "| mars | interactive |" in (out / "report.md").read_text()
    assert "  batch: done 5/5" in capsys.readouterr().err
    both = p.parse_args(["--classes", "batch:1@1", "--tenants", "b:1@1", "--out", str(out)])
    assert runner.main(both) == 2
    assert runner.main(p.parse_args(["--classes", "gold:1@1", "--out", str(out)])) == 2
    assert "unknown class gold" in capsys.readouterr().err
