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
