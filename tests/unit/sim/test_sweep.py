"""The sweep's workloads and the harness's hooks it relies on."""

from __future__ import annotations

import dataclasses
import io

import pytest

from marsproxy.aimd.admission import AdmissionCore
from marsproxy.cli import main as cli_main
from marsproxy.emulator.profiles import get_profile
from marsproxy.runs import options
from marsproxy.runs.arrivals import ArrivalSpec
from marsproxy.runs.trace import load_trace
from marsproxy.runs.workload import WorkloadSpec, build_workload
from marsproxy.sim.harness import SimSetup, Simulation
from marsproxy.sim.invariants import LightLoad, check_drained
from marsproxy.sim.sweep import CaseResult, _longest_call, make_case, run_case, summary, sweep

SETUP = SimSetup(profile=get_profile("tiny", num_blocks=1024), tool_cpus=4,
                 system_prompt_tokens=60)


def _run(send_final: bool, tool_calls: bool = True) -> tuple[Simulation, float, list[float]]:
    wl = build_workload(load_trace(), WorkloadSpec(
        sessions=4, seed=3, token_scale=0.05, tool_time_scale=0.01, max_turns=3,
        max_context_tokens=3000, arrivals=ArrivalSpec("poisson", 1.0)))
    cfg = options.proxy_config("mars", options.parse_sets([]), ["http://w0"])
    ticks: list[float] = []

    def seen(now: float, core: AdmissionCore) -> None:
        assert core is sim.core
        ticks.append(now)

    sim = Simulation(wl, "mars", dataclasses.replace(SETUP, send_final=send_final,
                                                     tool_calls=tool_calls), cfg, on_tick=seen)
    res = sim.run()
    assert all(o.ok for o in res.outcomes), [o.error for o in res.outcomes]
    return sim, float(res.extra["sim_end_s"]), ticks


def test_without_the_final_flag_sessions_end_on_answers_or_idle_and_nothing_is_left() -> None:
    flagged, flagged_end, ticks = _run(send_final=True)
    plain, plain_end, plain_ticks = _run(send_final=False)
    text, text_end, _ = _run(send_final=False, tool_calls=False)
    assert ticks and plain_ticks and ticks == sorted(ticks)
    # The run ends with its last session: a final flag or a tool-calling agent's answer.
    assert flagged_end < 30 and plain_end < 30
    assert flagged.core is not None and plain.core is not None and text.core is not None
    # Agents acting in text say nothing of their end: the proxy holds every session until its
    # idle timeout (60 s at least), then lets all of it go.
    assert text_end >= text.core.cfg.idle_timeout_min_s
    for sim, end in ((flagged, flagged_end), (plain, plain_end), (text, text_end)):
        assert len(sim.core.sessions) == 0
        assert check_drained(sim.core, sim.sched, sim.leftovers(), end) == []
        assert sim.stats["max_tools"] >= 1


def test_workloads_are_deterministic_and_every_call_fits_the_engine() -> None:
    traces = load_trace()
    kinds = set()
    modes: set[str] = set()
    for seed in range(40):
        case = make_case(seed, traces)
        again = make_case(seed, traces)
        assert case.workload == again.workload and case.label == again.label
        limit = case.setup.profile.effective_max_model_len
        system = case.setup.system_prompt_tokens
        assert all(_longest_call(s, system) <= limit for s in case.workload.sessions)
        assert 1 <= case.setup.workers <= 4
        kinds.add((case.setup.send_final, case.setup.report_tools, case.setup.tool_calls,
                   case.workload.spec.arrivals.kind))
        modes.add(case.setup.worker_mode)
    assert len(kinds) >= 8  # clients and arrival patterns vary
    assert modes == {"priority", "gated"}  # engines by priority, and FCFS behind the gate


def test_the_sweep_prints_the_same_report_twice() -> None:
    a, b = io.StringIO(), io.StringIO()
    assert sweep(3, 5, a) == sweep(3, 5, b)
    assert a.getvalue() == b.getvalue()
    assert "workloads: 3" in a.getvalue() and "violations:" in a.getvalue()


def test_the_cli_refuses_an_empty_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["sim", "--sweep", "0"]) == 2
    assert "--sweep needs N >= 1, got 0" in capsys.readouterr().err


def test_the_sweeps_overrides_reach_the_swept_proxy(capsys: pytest.CaptureFixture[str]) -> None:
    # Seed 3 (a burst of 9 on one small worker): sessions wait for admission on the defaults,
    # none with admission off; the report names the override. A bad one is refused up front.
    out = io.StringIO()
    sweep(1, 3, out)
    case = make_case(3, load_trace())
    assert run_case(case).waiting_ticks > 0
    off = io.StringIO()
    sweep(1, 3, off, ["admission.enabled=false"])
    assert run_case(case, ["admission.enabled=false"]).waiting_ticks == 0
    assert "admission.enabled=false" in off.getvalue().splitlines()[0]
    assert "waiting: 0" in off.getvalue() and "waiting: 0" not in out.getvalue()
    assert cli_main(["sim", "--sweep", "1", "--set", "admission.window_min=-3"]) == 2
    assert "window_min" in capsys.readouterr().err


def test_the_summary_says_where_the_proxy_is_worse_than_direct_at_any_load() -> None:
    traces = load_trace()
    cases = [make_case(seed, traces) for seed in range(4)]
    ratios = [0.7, 1.0, 1.2, 1.01]
    results = [CaseResult(c, versus=LightLoad(r, r, unfinished=int(r > 1.1)))
               for c, r in zip(cases, ratios, strict=True)]
    line = next(x for x in summary(results).splitlines() if x.startswith("all loads"))
    plain = 0 if cases[2].setup.send_final else 1
    assert line == (
        "all loads: mean E2E over direct's: median 1.010x, best 0.700x, worst 1.200x (seed 2:"
        f" {cases[2].label}); above 1.03x: 1 of 4 ({plain} without the final flag); sessions"
        " direct finished and the proxy did not: 1")
    # A heavy workload (seed 3: a burst of 9 on one small worker) is compared too.
    heavy = run_case(cases[3])
    assert heavy.light is None and heavy.versus is not None
    assert heavy.versus.mean_ratio < 1.0  # the proxy finishes them sooner than direct
