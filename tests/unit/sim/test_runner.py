"""`marsproxy sim` options that shape the agents: what the run's report says they sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marsproxy.cli import main as cli_main


@pytest.mark.parametrize("plain", [False, True])
def test_plain_clients_send_neither_final_flags_nor_tool_events(
    tmp_path: Path, plain: bool
) -> None:
    out = tmp_path / "run"
    args = ["sim", "--sessions", "3", "--rates", "1", "--regimes", "trace", "--profile", "tiny",
            "--token-scale", "0.05", "--tool-time-scale", "0.01", "--max-turns", "3",
            "--policies", "direct,mars", "--no-plots", "--out", str(out)]
    assert cli_main(args + (["--plain-clients"] if plain else [])) == 0
    data = json.loads((out / "results.json").read_text())
    meta = data["meta"]
    assert meta["agents flag their last call final"] is not plain
    assert meta["agents report tool events"] is not plain
    report = (out / "report.md").read_text()
    assert report.count("3/3 (100.0 %)") >= 2  # every session of both policies finished


def test_max_model_len_bounds_the_engines_and_the_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = ["sim", "--sessions", "4", "--rates", "1", "--regimes", "trace", "--profile", "tiny",
            "--token-scale", "0.5", "--tool-time-scale", "0.01", "--max-turns", "4",
            "--policies", "direct", "--no-plots", "--out", str(out)]
    assert cli_main([*args, "--max-model-len", "2048"]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["max_model_len"] == 2048
    turns = [t for r in data["runs"] for s in r["sessions"] for t in s["turns"]]
    assert turns and all(t["status"] == 200 for t in turns)
    assert max(t["prompt_tokens"] + t["completion_tokens"] for t in turns) <= 2048
    assert cli_main([*args, "--max-model-len", "0"]) == 2
    assert "max_model_len must be >= 1" in capsys.readouterr().err


def test_a_held_out_run_replays_only_sessions_never_tuned_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tuned = json.loads(
        (Path(__file__).parents[3] / "marsproxy/data/sample_trace.jsonl").read_text()
        .splitlines()[0])
    trace = tmp_path / "shared.jsonl"
    unseen = dict(tuned, id="unseen-1")
    trace.write_text(json.dumps(tuned) + "\n" + json.dumps(unseen) + "\n")
    out = tmp_path / "run"
    args = ["sim", "--trace", str(trace), "--sessions", "4", "--rates", "1", "--regimes",
            "trace", "--token-scale", "0.05", "--tool-time-scale", "0.01", "--max-turns", "2",
            "--policies", "direct", "--no-plots", "--out", str(out)]
    assert cli_main([*args, "--held-out"]) == 0
    data = json.loads((out / "results.json").read_text())
    assert "held out" in data["meta"]["trace"]
    ids = {s["id"].split("~")[0] for r in data["runs"] for s in r["sessions"]}
    assert ids == {"unseen-1"}
    # Nothing held out, or no trace to hold out from: a clear error before anything runs.
    trace.write_text(json.dumps(tuned) + "\n")
    assert cli_main([*args, "--held-out"]) == 2
    assert "none is held out" in capsys.readouterr().err
    assert cli_main(["sim", "--held-out", "--no-plots", "--out", str(out)]) == 2
    assert "name a trace file" in capsys.readouterr().err
