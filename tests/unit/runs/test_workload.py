"""Workload generation: seeded and deterministic, scaled as asked, arrivals as specified."""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import statistics
from pathlib import Path

import pytest

from marsproxy.runs.arrivals import ArrivalSpec, arrival_times
from marsproxy.runs.trace import load_trace
from marsproxy.runs.workload import REGIMES, WorkloadSpec, build_workload

# A full agent trace (e.g. the agentcgroup GLM runs), when the machine has one: MARS_TRACE=FILE.
SHARED_TRACE = Path(os.environ.get("MARS_TRACE", "/nonexistent"))


def test_same_spec_same_workload_bit_for_bit() -> None:
    traces = load_trace()
    spec = WorkloadSpec(sessions=40, seed=3, regime_peak_tokens=REGIMES["32k"], token_scale=0.5,
                        tool_time_scale=0.2, max_turns=12, arrivals=ArrivalSpec("poisson", 0.7))
    assert build_workload(traces, spec) == build_workload(load_trace(), spec)
    other = build_workload(traces, dataclasses.replace(spec, seed=4))
    assert other != build_workload(traces, spec)
    assert [s.arrival_s for s in other.sessions] != [
        s.arrival_s for s in build_workload(traces, spec).sessions]


def test_more_sessions_than_the_trace_get_unique_ids() -> None:
    wl = build_workload(load_trace(), WorkloadSpec(sessions=50, seed=1))
    ids = [s.id for s in wl.sessions]
    assert len(ids) == len(set(ids)) == 50
    assert len({s.trace_id for s in wl.sessions}) == 16  # every trace first, then repeats


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_regime_sets_the_median_peak_context(regime: str) -> None:
    target = REGIMES[regime]
    wl = build_workload(load_trace(), WorkloadSpec(sessions=16, seed=0,
                                                   regime_peak_tokens=target))
    peaks = [s.peak_tokens for s in wl.sessions]
    assert statistics.median(peaks) == pytest.approx(target, rel=0.01)
    for s in wl.sessions:
        inputs = [t.input_tokens for t in s.turns]
        assert inputs == sorted(inputs) and len(set(inputs)) == len(inputs), "append-only"
        assert s.turns[-1].tool_s is None


def test_scales_caps_and_context_limit() -> None:
    traces = load_trace()
    base = build_workload(traces, WorkloadSpec(sessions=16, seed=2))
    scaled = build_workload(traces, WorkloadSpec(sessions=16, seed=2, token_scale=0.5,
                                                 tool_time_scale=0.25, max_turns=5,
                                                 max_context_tokens=20_000))
    for a, b in zip(base.sessions, scaled.sessions, strict=True):
        assert a.id == b.id
        assert len(b.turns) == min(5, len(a.turns))
        assert b.peak_tokens <= 20_000
        assert b.turns[0].output_tokens == max(1, round(a.turns[0].output_tokens * 0.5))
        for ta, tb in zip(a.turns[:4], b.turns[:4], strict=False):
            assert tb.tool_s == pytest.approx((ta.tool_s or 0) * 0.25)
            assert tb.input_tokens <= round(ta.input_tokens * 0.5) + 5


def test_arrival_processes() -> None:
    rng = random.Random(1)
    assert arrival_times(ArrivalSpec("fixed", 2.0), 4, rng) == [0.0, 0.5, 1.0, 1.5]
    assert arrival_times(ArrivalSpec("burst", 0.5, burst_size=3), 7, rng) == [
        0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 4.0]
    assert arrival_times(ArrivalSpec("poisson", 0.0), 3, rng) == [0.0, 0.0, 0.0]
    times = arrival_times(ArrivalSpec("poisson", 4.0), 4001, random.Random(9))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.08)
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.1)  # exponential: sd = mean
    with pytest.raises(ValueError):
        ArrivalSpec("uniform", 1.0)  # type: ignore[arg-type]


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="no full trace (MARS_TRACE) on this machine")
def test_any_trace_file_and_paper_scale_sampling() -> None:
    wl = build_workload(load_trace(SHARED_TRACE), WorkloadSpec(
        sessions=300, seed=0, regime_peak_tokens=REGIMES["128k"]))
    d = wl.describe()
    assert d["sessions"] == 300 and d["peak_p50"] == pytest.approx(131_072, rel=0.01)
    assert d["peak_max"] <= 250_000


def test_shared_first_prompt_groups() -> None:
    traces = load_trace()
    spec = WorkloadSpec(sessions=10, seed=2, token_scale=0.2, max_context_tokens=6000,
                        arrivals=ArrivalSpec("poisson", 1.0))
    plain = build_workload(traces, spec)
    grouped = build_workload(traces, dataclasses.replace(spec, prefix_groups=3,
                                                         prefix_tokens=2000))
    assert {s.group for s in grouped.sessions} == {0, 1, 2}
    assert all(s.group is None and s.shared_tokens == 0 for s in plain.sessions)
    for p, g in zip(plain.sessions, grouped.sessions, strict=True):
        assert g.shared_tokens == 2000 and g.arrival_s == p.arrival_s
        assert g.peak_tokens <= 6000  # the prefix counts against the context limit
        if p.peak_tokens <= 4000:  # room enough: the same session behind the prefix
            assert [t.input_tokens - 2000 for t in g.turns] == [
                t.input_tokens for t in p.turns]
    with pytest.raises(ValueError, match="prefix_tokens"):
        WorkloadSpec(prefix_groups=2, prefix_tokens=8000, max_context_tokens=8000)
