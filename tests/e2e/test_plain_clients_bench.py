"""benchmarks/plain_clients.py on a short run, so the script cannot rot (no timing asserts)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_plain_clients_runs_direct_and_through_the_proxy() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plain_clients.py"), "--seconds", "1",
         "--rounds", "1", "--concurrency", "2", "--prompt-chars", "200", "--max-tokens", "4",
         "--agents", "1", "--light-agents", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    calls = dict(re.findall(r"^\s*(direct|marsproxy): (\d+) calls \(errors 0\)", done.stdout,
                            re.MULTILINE))
    assert set(calls) == {"direct", "marsproxy"} and all(int(n) > 0 for n in calls.values())
    assert re.search(r"mean marsproxy / direct: \d+\.\d\dx", done.stdout)
    for key in ("agents", "light"):  # each agent key's calls, direct and through the proxy
        runs = re.findall(rf"^\s*{key}: (\d+) calls \(errors 0\).*\((direct|marsproxy)\)$",
                          done.stdout, re.MULTILINE)
        assert sorted(w for _, w in runs) == ["direct", "marsproxy"], done.stdout
        assert all(int(n) > 0 for n, _ in runs)
