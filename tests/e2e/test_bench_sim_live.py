"""`marsproxy sim` and `marsproxy bench live` end to end on one tiny workload, and their ranking.

The workload is chosen so that the ranking is clear: 24 sessions arrive at once on one tiny
emulated worker with a 384-block KV cache (about 3 sessions' contexts), tools are short. Direct
traffic thrashes the cache (prefixes evicted between calls, re-prefilled); the admission window
holds sessions back until they fit. The simulator puts mars ~1.7× ahead of direct; the test
asks only that live agrees on every order the simulator is sure of (a gap over 20 %), not on
times, so a loaded 2-core machine does not make it flaky.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKLOAD = [
    "--regimes", "trace", "--token-scale", "0.1", "--tool-time-scale", "0.01",
    "--sessions", "24", "--rates", "0", "--max-turns", "8", "--time-scale", "2",
    "--num-blocks", "384", "--profile", "tiny", "--policies", "mars",
    # vLLM's --max-model-len on the engines (the cache holds 6144); prompts as without it
    "--max-model-len", "5632", "--max-context", "5120",
]


def _run(args: list[str], out: Path, stderr: list[str] | None = None) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "marsproxy.cli", *args, "--out", str(out)],
                       capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stdout.strip() == str(out / "report.md")
    assert (out / "report.md").exists()
    if stderr is not None:
        stderr.extend(r.stderr.splitlines())
    data: dict[str, Any] = json.loads((out / "results.json").read_text())
    return data


def _means(data: dict[str, Any]) -> dict[str, float]:
    (fig,) = data["figures"]
    return {p: s["mean_s"] for p, s in fig["summaries"].items()}


def test_sim_and_live_agree_on_the_ranking(tmp_path: Path) -> None:
    sim = _run(["sim", *WORKLOAD, "--tool-cpus", "2"], tmp_path / "sim")
    live = _run(["bench", "live", *WORKLOAD], tmp_path / "live")
    for data in (sim, live):
        runs = {r["policy"]: r for r in data["runs"]}
        assert set(runs) == {"direct", "mars"}
        for r in runs.values():
            assert r["summary"]["finished"] == 24, r["summary"]
            assert all(len(s["turns"]) == s["planned_turns"] for s in r["sessions"])
        # the admission window held sessions back, seen on the proxy's event stream
        assert max(v for _, v in runs["mars"]["timeline"]["queue"]) >= 10
    # the emulated worker runs --scheduling-policy priority and the proxy is told so (levels
    # in the body, as the simulator's default worker mode; not the gated dispatch queue)
    proxy_cfg = (tmp_path / "live" / "logs" / "proxy-mars.yaml").read_text()
    assert "priority: true" in proxy_cfg
    # the benchmark's queue deadline (a day: every session finishes) reaches the proxy, and
    # the agents wait that long plus a call's allowance
    assert "queue_deadline_s: 86400.0" in proxy_cfg
    assert live["meta"]["queue deadline"].startswith("86400 s (a day")
    assert live["meta"]["agent call timeout_s"] == 86400 + 900
    # the proxy's whole event stream is kept, one JSON object per line
    (events,) = (tmp_path / "live" / "logs").glob("events-*-mars.jsonl")
    kinds = {json.loads(line)["type"] for line in events.read_text().splitlines()}
    assert {"session_queued", "session_admitted", "dispatch", "llm_end"} <= kinds
    # and its state, read about once a second: the limit, the caps and the queue over time
    (state,) = (tmp_path / "live" / "logs").glob("state-*-mars.jsonl")
    rows = [json.loads(line) for line in state.read_text().splitlines()]
    assert all(isinstance(x["recv_ts"], float) for x in rows)
    snaps = [x for x in rows if "error" not in x]
    assert len(snaps) >= len(rows) - 1, rows  # a read may fail at most as the proxy stops
    assert max(x["admission"]["queue"]["length"] for x in snaps) > 0
    (worker,) = snaps[0]["admission"]["workers"].values()
    assert {"limit", "cpu_cap", "peak_overcommit"} <= set(worker)
    # the engines' --max-model-len, as the proxy read it from /v1/models
    assert [w["max_model_len"] for w in snaps[-1]["workers"]] == [5632]
    assert sim["meta"]["max_model_len"] == live["meta"]["max_model_len"] == 5632
    assert runs["mars"]["extra"]["state_snapshots"] == len(rows)
    # what each run cost the host, the proxy's process apart (direct has none)
    cpu = {p: r["extra"]["cpu"] for p, r in runs.items()}
    assert cpu["direct"]["process_cores"] is None
    assert 0 < cpu["mars"]["process_cores"] < cpu["mars"]["host_busy_cores"]
    assert all(0 < c["host_busy_cores"] <= c["cores"] for c in cpu.values()), cpu
    assert "(proxy " in (tmp_path / "live" / "report.md").read_text()
    assert list((tmp_path / "live").glob("cdf-*.png"))
    assert list((tmp_path / "live").glob("timeline-*mars.png"))
    s, lv = _means(sim), _means(live)
    sure = [(a, b) for a in s for b in s if s[a] * 1.2 < s[b]]
    assert sure, f"the simulator separates no policies: {s}"
    for faster, slower in sure:
        assert lv[faster] < lv[slower], f"sim {s} vs live {lv}"


def test_sim_over_several_seeds_reports_each_and_their_mean(tmp_path: Path) -> None:
    data = _run(["sim", *WORKLOAD, "--sessions", "6", "--seeds", "4,7", "--no-plots",
                 "--state-every", "0.5"], tmp_path)
    loads = [(f["seed"], f["load"]) for f in data["figures"]]
    assert loads == [(4, "poisson 0/s"), (7, "poisson 0/s")]
    assert [r["seed"] for r in data["runs"]] == [4, 4, 7, 7]
    # different seeds sample different sessions
    ids = [sorted(s["id"] for s in r["sessions"]) for r in data["runs"]]
    assert ids[0] == ids[1] and ids[0] != ids[2]
    (avg,) = data["over_seeds"]
    per_seed = [f["ratios"]["mars"]["mean_vs_direct"] for f in data["figures"]]
    assert avg["policies"]["mars"]["mean_vs_direct_per_seed"] == per_seed
    assert data["meta"]["seed"] == "4, 7"
    assert "mean over seeds 4, 7" in (tmp_path / "report.md").read_text()
    # state snapshots of each proxied run, named as `bench live` names its own
    states = sorted(p.name for p in (tmp_path / "logs").glob("state-*.jsonl"))
    assert states == ["state-trace_poisson_0_s_seed_4-mars.jsonl",
                      "state-trace_poisson_0_s_seed_7-mars.jsonl"]
    for run in (r for r in data["runs"] if r["policy"] == "mars"):
        path = tmp_path / "logs" / f"state-trace_poisson_0_s_seed_{run['seed']}-mars.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert run["extra"]["state_snapshots"] == len(rows) > 0
        assert {"window", "peak_room_blocks", "admitted"} <= set(
            rows[0]["admission"]["workers"]["w0"])


def test_sim_counts_refused_sessions_and_lifts_the_deadline_by_default(tmp_path: Path) -> None:
    # By default the queue deadline is the horizon: every session finishes under both policies.
    lifted = _run(["sim", *WORKLOAD, "--tool-cpus", "2", "--no-plots"], tmp_path / "lifted")
    assert lifted["meta"]["queue deadline"].startswith("1e+07 s (the horizon")
    for r in lifted["runs"]:
        assert r["summary"]["finished"] == 24 and r["summary"]["completion"] == 1.0
    # One second of patience: mars refuses most of the 24 (they arrive at once on a cache for
    # about 3); each counts from its arrival to its refusal, in the mean and the percentiles.
    err: list[str] = []
    tight = _run(["sim", *WORKLOAD, "--tool-cpus", "2", "--no-plots", "--queue-deadline", "1",
                  "--set", "admission.tuning.aging_margin_s=0.1"], tmp_path / "tight", err)
    assert tight["meta"]["queue deadline"] == "1 s (set for this run)"
    runs = {r["policy"]: r for r in tight["runs"]}
    mars = runs["mars"]
    refused = [x for x in mars["sessions"] if x["refused"]]
    assert refused and all(x["status"] == "refused" and x["e2e_s"] is None for x in refused)
    assert all(1.0 <= x["counted_s"] <= 1.2 for x in refused)
    counted = [x["counted_s"] for x in mars["sessions"]]
    assert mars["summary"]["mean_s"] == pytest.approx(sum(counted) / 24)
    assert mars["summary"]["rejected"] == len(refused)
    assert mars["summary"]["completion"] == pytest.approx(1 - len(refused) / 24)
    assert runs["direct"]["summary"]["completion"] == 1.0  # no proxy, no deadline
    # Every ratio of mars's says it compares an incomplete run with a complete one, in the
    # report and in the lines printed at the end.
    pct = f"{100 * mars['summary']['completion']:.1f} %"
    row = next(line for line in (tmp_path / "tight" / "report.md").read_text().splitlines()
               if line.startswith("| mars |"))
    assert row.count(f"({pct} vs 100.0 %)") == 4 and f"| {24 - len(refused)}/24 ({pct}) |" in row
    (line,) = [x for x in err if x.startswith("trace poisson 0/s mars: done")]
    assert f"refused {len(refused)}, failed 0; mean ≥" in line and f"({pct} vs 100.0 %)" in line


def test_a_fixed_window_holds_n_sessions_in_the_sim_and_live(tmp_path: Path) -> None:
    # The yardstick "the best fixed window chosen in hindsight" in one command: window-N runs
    # mars with its window pinned at N and no forecast fit, beside the other policies.
    args = [*WORKLOAD, "--sessions", "8", "--policies", "mars,window-2", "--no-plots",
            "--state-every", "0.2"]
    sim = _run(["sim", *args], tmp_path / "sim")
    live = _run(["bench", "live", *args[:-2]], tmp_path / "live")
    for data, out in ((sim, tmp_path / "sim"), (live, tmp_path / "live")):
        runs = {r["policy"]: r for r in data["runs"]}
        assert set(runs) == {"direct", "mars", "window-2"}
        assert all(r["summary"]["finished"] == 8 for r in runs.values())
        (state,) = (out / "logs").glob("state-*-window-2.jsonl")
        rows = [json.loads(line) for line in state.read_text().splitlines()]
        workers = [next(iter(x["admission"]["workers"].values()))
                   for x in rows if "error" not in x]
        assert workers and all(w["window"] == w["effective_limit"] == 2 and w["admitted"] <= 2
                               for w in workers)
        assert max(w["admitted"] for w in workers) == 2
        # mars, beside it, is not held to 2: the 8 sessions arrive at once
        (state,) = (out / "logs").glob("state-*-mars.jsonl")
        assert max(next(iter(json.loads(line)["admission"]["workers"].values()))["admitted"]
                   for line in state.read_text().splitlines()
                   if "error" not in json.loads(line)) > 2
    proxy_cfg = (tmp_path / "live" / "logs" / "proxy-window-2.yaml").read_text()
    assert "window_max: 2" in proxy_cfg and "kv_fit_peak: false" in proxy_cfg
