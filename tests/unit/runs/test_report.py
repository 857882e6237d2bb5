"""Report figures on a hand-made result set, worked out by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from marsproxy.runs import report
from marsproxy.runs.results import RunResult, SessionOutcome, TurnOutcome, percentile, summarize


def _session(sid: str, arrival: float, ideal: float, end: float | None, ttfts: list[float],
             cached: list[int], status: int = 200) -> SessionOutcome:
    o = SessionOutcome(sid, arrival, ideal, planned_turns=len(ttfts))
    for i, (t, c) in enumerate(zip(ttfts, cached, strict=True)):
        o.turns.append(TurnOutcome(arrival + i, t, 1.0, status, prompt_tokens=1000 * (i + 1),
                                   cached_tokens=c, completion_tokens=10))
    o.end_s = end
    return o


def _refused(sid: str, arrival: float, after: float, status: int = 503) -> SessionOutcome:
    """A session whose first call waited ``after`` seconds in the queue, then was refused."""
    o = SessionOutcome(sid, arrival, 10, planned_turns=2)
    o.turns.append(TurnOutcome(arrival, None, after, status))
    o.stopped_s = arrival + after
    o.error = "no admission slot within the queue deadline"
    return o


def _runs() -> list[RunResult]:
    # direct: e2e 10, 20, 30, 40 (ideal 10 each → within 3×: 10, 20, 30); makespan 0 → 40.
    direct = [
        _session("a", 0, 10, 10, [0.1, 0.2], [0, 900]),   # warm (900 ≥ 0.9 × 1000)
        _session("b", 0, 10, 20, [0.3, 0.4], [0, 100]),   # cold
        _session("c", 0, 10, 30, [0.5, 0.6], [0, 950]),   # warm
        _session("d", 0, 10, 40, [0.7, 0.8], [0, 0]),     # cold
    ]
    # mars: e2e 5, 10, 15 and one refused (503) after 6 s in the queue; makespan 0 → 15.
    mars = [
        _session("a", 0, 10, 5, [0.1, 0.1], [0, 1000]),
        _session("b", 0, 10, 10, [0.1, 0.1], [0, 1000]),
        _session("c", 0, 10, 15, [0.1, 0.1], [0, 1000]),
        _refused("d", 0, 6.0),
    ]
    # fcfs: e2e 8 for all four; makespan 8.
    fcfs = [_session(s, 0, 10, 8, [1.0, 1.0], [0, 0]) for s in "abcd"]
    return [RunResult("direct", "32k", "heavy", direct), RunResult("fcfs", "32k", "heavy", fcfs),
            RunResult("mars", "32k", "heavy", mars)]


def test_summary_by_hand() -> None:
    direct, fcfs, mars = (r.summary() for r in _runs())
    assert (direct.finished, direct.rejected, direct.failed) == (4, 0, 0)
    assert direct.mean_s == 25.0
    assert direct.p50_s == 25.0  # between 20 and 30
    assert direct.p90_s == pytest.approx(37.0)  # 30 + 0.7 × 10
    assert direct.p95_s == pytest.approx(38.5)
    assert direct.makespan_s == 40.0
    assert direct.within_slo == 3
    assert direct.goodput_per_s == pytest.approx(3 / 40)
    assert direct.throughput_per_s == pytest.approx(4 / 40)
    assert direct.warm_resume_rate == 0.5
    assert direct.ttft_p50_s == pytest.approx(0.45)
    assert direct.slowdown_mean == pytest.approx(2.5)
    assert direct.completion == 1.0 and direct.mean_finished_s == 25.0
    assert (mars.finished, mars.rejected, mars.failed) == (3, 1, 0)
    assert mars.completion == 0.75
    # The refused session counts at its refusal, 6 s after arrival: 5, 6, 10, 15.
    assert mars.mean_s == 9.0 and mars.mean_finished_s == 10.0
    assert mars.p50_s == 8.0  # between 6 and 10
    assert mars.p95_s == pytest.approx(14.25)  # 10 + 0.85 × 5
    assert mars.slowdown_mean == pytest.approx(0.9)
    assert mars.makespan_s == 15.0
    assert mars.goodput_per_s == pytest.approx(3 / 15)  # a refused session is never goodput
    assert mars.throughput_per_s == pytest.approx(3 / 15)
    assert mars.warm_resume_rate == 1.0
    assert fcfs.mean_s == 8.0 and fcfs.goodput_per_s == pytest.approx(4 / 8)


def test_unfinished_sessions_count_until_they_stopped_and_are_told_apart() -> None:
    done = _session("a", 0, 10, 4, [0.1], [0])
    refused = _refused("b", 2, 30, status=429)
    # Failed: an upstream error on its second call, at 12 s (arrival 1).
    failed = _session("c", 1, 10, None, [0.1, 0.1], [0, 0])
    failed.planned_turns = 3
    failed.turns[1].status = 502
    failed.stopped_s = 12
    # Still running when the simulator gave up at its horizon (no turn of it ended).
    horizon = SessionOutcome("d", 3, 10, planned_turns=1, stopped_s=50,
                             error="unfinished at the simulation horizon")
    outcomes = [done, refused, failed, horizon]
    assert [o.status for o in outcomes] == ["finished", "refused", "failed", "failed"]
    assert [o.counted_s for o in outcomes] == [4, 30, 11, 47]
    s = summarize(outcomes)
    assert (s.sessions, s.finished, s.rejected, s.failed, s.completion) == (4, 1, 1, 2, 0.25)
    assert s.mean_s == pytest.approx((4 + 30 + 11 + 47) / 4)
    assert s.p50_s == pytest.approx(20.5) and s.p95_s == pytest.approx(44.45)
    assert s.mean_finished_s == 4
    # The makespan runs to the last stop (the horizon, 50 s), not the last finish (4 s).
    assert s.makespan_s == 50 and s.throughput_per_s == pytest.approx(1 / 50)
    # Without a stop time (a result built by hand), the end of its last call.
    refused.stopped_s = None
    assert refused.counted_s == 30 and refused.last_s == 32


def test_ratios_against_direct_and_the_best_other() -> None:
    summaries = {r.policy: r.summary() for r in _runs()}
    rs = report.ratios(summaries)
    # best other by mean: fcfs (8 s); by goodput: fcfs (0.5/s); by P95: fcfs (8 s).
    # mars's latencies count its refused session at 6 s: 5, 6, 10, 15.
    assert rs["mars"]["mean_vs_direct"] == pytest.approx(25 / 9)
    assert rs["mars"]["mean_vs_best_other"] == pytest.approx(8 / 9)
    assert rs["mars"]["goodput_vs_best_other"] == pytest.approx(0.2 / 0.5)
    assert rs["mars"]["p95_vs_best_other"] == pytest.approx(8 / percentile([5, 6, 10, 15], 95))
    assert rs["fcfs"]["mean_vs_best_other"] == 1.0
    assert rs["direct"]["mean_vs_direct"] == 1.0
    # Each ratio carries the completion of the run it divides (both baselines finished all).
    assert rs["mars"]["mean_vs_direct_base_completion"] == 1.0
    assert rs["mars"]["p95_vs_best_other_base_completion"] == 1.0


def test_percentile_and_empty_sets() -> None:
    assert percentile([3, 1, 2], 50) == 2
    assert math.isnan(percentile([], 50))
    empty = summarize([])
    assert empty.sessions == 0 and math.isnan(empty.mean_s) and math.isnan(empty.goodput_per_s)


def test_written_report_and_json(tmp_path: Path) -> None:
    runs = _runs()
    md = report.write(tmp_path, runs, "test run", {"kind": "unit"}, make_plots=True)
    text = md.read_text()
    assert "## regime 32k, load heavy" in text
    head = next(line for line in text.splitlines() if line.startswith("| policy |"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    # The completion stands right before the ratios.
    assert cols[cols.index("done") + 1:cols.index("done") + 3] == ["mean ×direct",
                                                                 "mean ×best other"]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith(("| direct", "| fcfs", "| mars"))}
    mars = dict(zip(cols, rows["mars"], strict=True))
    # mars refused one of four: its latencies are lower bounds, its ratios say so.
    assert (mars["mean s"], mars["P50 s"], mars["P95 s"]) == ("≥9.0", "≥8.0", "≥14.2")
    assert (mars["refused"], mars["failed"], mars["done"]) == ("1", "0", "3/4 (75.0 %)")
    assert mars["mean ×direct"] == "2.78 (75.0 % vs 100.0 %)"
    assert mars["mean ×best other"] == "0.89 (75.0 % vs 100.0 %)"
    assert mars["goodput ×best other"] == "0.40 (75.0 % vs 100.0 %)"
    direct = dict(zip(cols, rows["direct"], strict=True))
    assert (direct["mean s"], direct["done"], direct["mean ×direct"]) == (
        "25.0", "4/4 (100.0 %)", "1.00")
    # fcfs against itself (the best other) and direct: both complete, no flag.
    assert dict(zip(cols, rows["fcfs"], strict=True))["mean ×best other"] == "1.00"
    assert "Best other policy by mean latency: `fcfs`." in text
    assert "Not every session finished: latencies marked ≥" in text
    data = json.loads((tmp_path / "results.json").read_text())
    fig = data["figures"][0]
    assert fig["summaries"]["direct"]["mean_s"] == 25.0
    assert len(data["runs"]) == 3 and len(data["runs"][2]["sessions"]) == 4
    refused = data["runs"][2]["sessions"][3]
    assert refused["e2e_s"] is None  # NaN-free JSON
    assert (refused["status"], refused["refused"], refused["counted_s"]) == ("refused", True, 6.0)
    assert fig["summaries"]["mars"]["completion"] == 0.75
    assert fig["ratios"]["mars"]["mean_vs_direct_base_completion"] == 1.0
    assert (tmp_path / "cdf-32k-heavy.png").stat().st_size > 1000


def _seeded(seed: int, direct_end: float, mars_end: float) -> list[RunResult]:
    # One session per policy, e2e = its end (arrival 0, ideal 10).
    return [RunResult(p, "trace", "heavy", [_session("a", 0, 10, end, [0.1], [0])], seed=seed)
            for p, end in (("direct", direct_end), ("mars", mars_end))]


def test_several_seeds_are_separate_workloads_then_averaged(tmp_path: Path) -> None:
    # Seed 0: direct 30 s, mars 10 s (3×); seed 1: direct 20 s, mars 40 s (0.5×).
    runs = _seeded(0, 30, 10) + _seeded(1, 20, 40)
    assert list(report.groups(runs)) == [("trace", "heavy, seed 0"), ("trace", "heavy, seed 1")]
    [fig] = report.over_seeds(runs)
    assert (fig["regime"], fig["load"], fig["seeds"]) == ("trace", "heavy", [0, 1])
    mars = fig["policies"]["mars"]
    assert mars["seeds"] == 2
    assert mars["mean_vs_direct_per_seed"] == [3.0, 0.5]
    # The mean of the ratios, not the ratio of the means (25 / 25 = 1).
    assert mars["mean"]["mean_vs_direct"] == pytest.approx(1.75)
    assert mars["mean"]["mean_s"] == pytest.approx(25.0)
    # Goodput: seed 0 within 3× ideal (1/10 s), seed 1 not (0).
    assert mars["mean"]["goodput_per_s"] == pytest.approx(0.05)
    assert fig["policies"]["direct"]["mean"]["mean_vs_direct"] == 1.0

    text = report.write(tmp_path, runs, "seeds", {}, make_plots=False).read_text()
    assert "## regime trace, load heavy, seed 1" in text
    assert "## regime trace, load heavy: mean over seeds 0, 1" in text
    assert "| mars | 2 | 25.0 | " in text and "| 100.0 % | 1.75 | 3.00 0.50 |" in text
    data = json.loads((tmp_path / "results.json").read_text())
    assert [f["seed"] for f in data["figures"]] == [0, 1]
    assert data["figures"][1]["load"] == "heavy"
    assert data["over_seeds"][0]["policies"]["mars"]["mean_vs_direct_per_seed"] == [3.0, 0.5]
    assert data["runs"][3]["seed"] == 1


def test_the_best_fixed_window_over_the_seeds_is_named_beside_mars(tmp_path: Path) -> None:
    # direct 30 / 20 s; mars 10 / 40 s (3×, 0.5×: 1.75); window-2 15 / 10 s (2×, 2×: 2.0);
    # window-3 10 / 20 s (3×, 1×: 2.0 as well; the first best stands); window-4 refuses seed 1's
    # session (its mean is over unlike runs: named with its completion).
    def run(p: str, seed: int, end: float) -> RunResult:
        return RunResult(p, "trace", "heavy", [_session("a", 0, 10, end, [0.1], [0])], seed=seed)
    runs = [*_seeded(0, 30, 10), run("window-2", 0, 15), run("window-3", 0, 10),
            run("window-4", 0, 30), *_seeded(1, 20, 40), run("window-2", 1, 10),
            run("window-3", 1, 20),
            RunResult("window-4", "trace", "heavy", [_refused("a", 0, 1)], seed=1)]
    [fig] = report.over_seeds(runs)
    assert report.yardstick(fig) == [
        "", "Best fixed window over these seeds (mean ×direct): `window-2` 2.00, done 100.0 %"
        " (window-4 10.50, done 50.0 %); mars 1.75, done 100.0 %: 0.88 of it."]
    text = report.write(tmp_path, runs, "seeds", {}, make_plots=False).read_text()
    assert "Best fixed window over these seeds" in text
    assert report.yardstick(report.over_seeds(_seeded(0, 30, 10) + _seeded(1, 20, 40))[0]) == []


def test_one_seed_has_no_average() -> None:
    runs = _runs()
    assert report.over_seeds(runs) == []
    assert list(report.groups(runs)) == [("32k", "heavy")]


def test_seeds_table_flags_the_seeds_whose_runs_left_sessions_unfinished(tmp_path: Path) -> None:
    # Seed 0: both finish (direct 30 s, mars 10 s); seed 1: mars refuses its one session after
    # 5 s (counted at 5 s: 20 / 5 = 4×, but a 0 % completion), direct finishes in 20 s.
    runs = [
        *_seeded(0, 30, 10),
        RunResult("direct", "trace", "heavy", [_session("a", 0, 10, 20, [0.1], [0])], seed=1),
        RunResult("mars", "trace", "heavy", [_refused("a", 0, 5)], seed=1)]
    [fig] = report.over_seeds(runs)
    mars = fig["policies"]["mars"]
    assert mars["mean_vs_direct_per_seed"] == [3.0, 4.0]
    assert mars["completion_per_seed"] == [1.0, 0.0]
    assert mars["direct_completion_per_seed"] == [1.0, 1.0]
    assert mars["mean"]["completion"] == 0.5
    assert mars["incomplete_seeds"]["mean_vs_direct"] == 1
    assert fig["policies"]["direct"]["incomplete_seeds"]["mean_vs_direct"] == 0
    text = report.write(tmp_path, runs, "seeds", {}, make_plots=False).read_text()
    line = next(x for x in text.splitlines() if x.startswith("| mars | 2 |"))
    assert "| ≥7.5 | ≥7.5 |" in line  # mean of 10 and 5: seed 1 counts a refusal
    assert "| 50.0 % | 3.50 (incomplete in 1 of 2 seeds) | 3.00 4.00 (0.0 % vs 100.0 %) |" in line
    assert "seed 1" in text and "| 0/1 (0.0 %) |" in text


def test_summary_lines_give_completion_next_to_the_ratio() -> None:
    lines = report.summary_lines(_runs())
    assert lines == [
        "32k heavy direct: done 4/4 (100.0 %), refused 0, failed 0; mean 25.0 s",
        "32k heavy fcfs: done 4/4 (100.0 %), refused 0, failed 0; mean 8.0 s, ×direct 3.12",
        "32k heavy mars: done 3/4 (75.0 %), refused 1, failed 0; mean ≥9.0 s,"
        " ×direct 2.78 (75.0 % vs 100.0 %)",
    ]
    assert report.done_note(_runs()[2]) == "done 3/4 (75.0 %), refused 1, failed 0"


def test_cpu_line_gives_each_runs_host_cores_and_the_proxys_share(tmp_path: Path) -> None:
    runs = _runs()
    runs[0].extra["cpu"] = {"wall_s": 40.0, "cores": 2.0, "host_busy_cores": 1.5,
                            "process_cores": None}
    runs[2].extra["cpu"] = {"wall_s": 15.0, "cores": 2.0, "host_busy_cores": 1.62,
                            "process_cores": 0.071}
    text = report.write(tmp_path, runs, "test run", {"kind": "unit"}, make_plots=False).read_text()
    assert ("Cores busy on average during the run, of 2 (the whole host; the proxy's own): "
            "direct 1.50, mars 1.62 (proxy 0.07).") in text
    # a run without the measurement (the simulator's) has no such line
    text = report.write(tmp_path, _runs(), "test run", {}, make_plots=False).read_text()
    assert "Cores busy" not in text
