"""`marsproxy demo` runs to completion as a real command, with a small session count.

The default demo (a longer burst that really overloads the tiny workers) takes ~30 s; these
runs are small, so they check the flow and what the summary reports, not the pressure.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from marsproxy.bench.procs import RedisServer

SMALL = ["--sessions", "4", "--calm-sessions", "2", "--max-turns", "3",
         "--tool-time-scale", "0.01", "--time-scale", "0.2"]


def _demo(*args: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "marsproxy.cli", "demo", *SMALL, *args],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _row(out: str, name: str) -> list[int | None]:
    """A timeline row's cells; '-' (a limit with no count bound) is None."""
    m = re.search(rf"^  {re.escape(name)}\s+([\d |?-]+)$", out, re.M)
    assert m is not None, f"no timeline row {name!r} in:\n{out}"
    return [None if x == "-" else int(x) for x in m.group(1).replace("|", " ").split()]


def test_demo_compares_without_and_with_admission() -> None:
    out = _demo()
    assert "sessions finished: 6/6" in out
    assert "LLM calls: 18 ok, 0 failed" in out
    # Two workers served the sessions; affinity keeps each session on one worker, so the
    # append-only histories hit the prefix cache on later turns.
    served = [int(n) for n in re.findall(r"requests (\d+),", out)]
    assert len(served) == 2 and sum(served) == 18
    rates = [int(n) for n in re.findall(r"prefix-cache hit rate (\d+)%", out)]
    assert max(rates) > 30
    # Every session went through the admission window, which reports what it did.
    assert "admission: 6 sessions admitted" in out
    # The same load ran without admission first, on fresh workers: both runs side by side.
    side = re.findall(r"^(without|with) admission\s+sessions (\d+)/(\d+).*preemptions (\d+)",
                      out, re.M)
    assert [(s[0], s[1], s[2]) for s in side] == [("without", "6", "6"), ("with", "6", "6")]
    # The window timeline: one column per sample, the calm phase marked.
    window = _row(out, "w0 window")
    assert window and all(4 <= w <= 30 for w in window)
    assert len(_row(out, "w1 KV %")) == len(window) == len(_row(out, "waiting"))
    assert "'|' marks the start of the calm phase" in out


@pytest.mark.skipif(not RedisServer.available(), reason="redis-server not installed")
def test_demo_with_two_replicas_shares_one_window() -> None:
    out = _demo("--replicas", "2", "--no-compare")
    assert re.search(r"redis-server of the demo's own: redis://127\.0\.0\.1:\d+/0", out)
    assert "sessions finished: 6/6" in out
    assert "without admission" not in out
    for w in ("w0", "w1"):
        assert len(_row(out, f"{w} admitted r0")) == len(_row(out, f"{w} admitted r1"))
    # '-': the limit never bounded the count there (no overload in a small calm run).
    peaks = re.findall(r"(w\d): (\d+) \(limit at most (\d+|-)\)", out)
    assert len(peaks) == 2
    assert all(limit == "-" or int(peak) <= int(limit) for _, peak, limit in peaks), peaks
    assert "admission: 6 sessions admitted" in out  # events of both replicas together


def test_demo_replicas_without_redis_server_says_why_and_stops() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "marsproxy.cli", "demo", "--replicas", "2"],
        capture_output=True, text=True, timeout=60, check=False, env={"PATH": "/nonexistent"},
    )
    assert r.returncode == 0, r.stderr
    assert "needs redis-server" in r.stdout and "skipped" in r.stdout
    assert "sessions finished" not in r.stdout


@pytest.mark.parametrize("policy", ["fcfs", "autellix", "continuum", "mars-no-retention"])
def test_demo_runs_with_a_policy_preset(policy: str) -> None:
    # The main run uses the preset; tests/e2e/test_policy_presets.py checks each preset's
    # behaviour on the same replay path in-process.
    out = _demo("--no-compare", "--policy", policy)
    assert "sessions finished: 6/6" in out and "LLM calls: 18 ok, 0 failed" in out
    assert f"policy {policy}" in out
    admits = policy == "mars-no-retention"
    assert ("(admission on)" in out) is admits and ("(admission off)" in out) is not admits


def test_default_demo_limit_binds_in_the_burst_and_lifts() -> None:
    # The main job on its defaults (~40 s): what the README promises it shows.
    r = subprocess.run(
        [sys.executable, "-m", "marsproxy.cli", "demo"],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "sessions finished: 30/30" in out
    # The burst's tools overload the 3 declared CPUs: the CPU cap, ceil(3 · 4) = 12, bounds the
    # limit on some worker (the first column is the stale start), and once the burst has
    # passed no count bounds it any more ('-'): the KV fit alone decides.
    bound = False
    for w in ("w0", "w1"):
        limit = _row(out, f"{w} limit")
        bound |= any(lim is not None for lim in limit[1:])
        assert limit[-1] is None, out
    assert bound, f"the limit never bound under pressure:\n{out}"
    # Admission holds sessions back and spares the engines the preemptions of the run without.
    pre = dict(re.findall(r"^(without admission|with admission)\s.*preemptions (\d+)", out, re.M))
    assert int(pre["with admission"]) < int(pre["without admission"]), out
    assert re.search(r"^  waiting\s+.*[1-9]", out, re.M), "no session waited"
