"""`marsproxy demo` runs to completion as a real command, with a small session count."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_runs_to_completion() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "marsproxy.cli", "demo", "--sessions", "3", "--max-turns", "3",
         "--tool-time-scale", "0.01", "--time-scale", "0.05"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "sessions finished: 3/3" in out
    assert "LLM calls: 9 ok, 0 failed" in out
    # Two workers served the sessions; affinity keeps each session on one worker, so the
    # append-only histories hit the prefix cache on later turns.
    served = [int(n) for n in re.findall(r"requests (\d+),", out)]
    assert len(served) == 2 and sum(served) == 9
    rates = [int(n) for n in re.findall(r"prefix-cache hit rate (\d+)%", out)]
    assert max(rates) > 30
    # Every session went through the admission window, which reports what it did.
    assert "admission: 3 sessions admitted" in out
    cached = [float(x) for x in re.findall(r"\s(\d+\.\d)%\s", out)]
    assert all(c > 0 for c in cached), out
