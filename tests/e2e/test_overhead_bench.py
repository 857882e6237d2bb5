"""benchmarks/overhead/run.py end to end on a tiny setting, so the script cannot rot.

Real subprocesses: the bench upstream, `marsproxy serve` (fcfs and mars) and wrk. Only the
result file's shape and sanity are checked; the numbers themselves are not (no timing asserts).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    shutil.which("wrk") is None, reason="wrk is not installed (.ci/run installs it)"
)


def test_overhead_benchmark_writes_sane_results(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    done = subprocess.run(
        [
            sys.executable, str(ROOT / "benchmarks" / "overhead" / "run.py"),
            "--targets", "direct,aiohttp-relay,marsproxy-fcfs,marsproxy-mars,litellm",
            "--points", "tiny", "--duration", "1", "--warmup", "0", "--rounds", "1",
            "--out", str(out), "--workdir", str(tmp_path / "work"),
            "--litellm-venv", str(tmp_path / "no-litellm"),
        ],
        cwd=ROOT, capture_output=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stdout.decode()[-2000:] + done.stderr.decode()[-2000:]
    result = json.loads(out.read_text())

    # A leg whose proxy is not installed is skipped and said so, not failed.
    assert set(result["skipped"]) == {"litellm"}
    assert "--install" in result["skipped"]["litellm"]

    rows = {(s["point"], s["target"]): s for s in result["summary"]}
    targets = ("direct", "aiohttp-relay", "marsproxy-fcfs", "marsproxy-mars")
    points = ("ns-r200-c4", "ns-1call-r100-c1", "sse-max-c2")
    assert set(rows) == {(p, t) for p in points for t in targets}
    for (point, target), s in rows.items():
        assert s["requests"] > 0 and s["errors"] == 0, s
        assert 0 < s["p50_ms"] <= s["p99_ms"], s
        assert s["rps"] > 0, s
        assert s["upstream_cpu_s_per_1000"] >= 0, s
        if target == "direct":
            assert s["added_p50_ms"] is None and s["proxy_cpu_s_per_1000"] is None
        else:
            assert isinstance(s["added_p50_ms"], float), s
            assert s["proxy_cpu_s_per_1000"] > 0, s  # read from /proc for the proxy process
            assert s["req_per_cpu_s"] == pytest.approx(1000 / s["proxy_cpu_s_per_1000"], abs=1)
            assert s["proxy_cpu_wait_ms_per_request"] >= 0, s
        if target.startswith("marsproxy"):  # against the relay, side by side; its sign is
            # the benchmark's to report (one 1 s round can read below the relay's: noise)
            assert s["added_p50_vs_relay"] is None or isinstance(
                s["added_p50_vs_relay"], float), s
        else:
            assert s["added_p50_vs_relay"] is None, s
        if point.startswith("sse"):
            assert s["chunks_per_s"] == pytest.approx(s["rps"] * 100, rel=0.01), s
        else:
            assert s["chunks_per_s"] is None

    goals = {g["goal"]: g for g in result["goals"]}
    measured = [g for g in goals.values() if g["value"] is not None and g["limit"] is not None]
    # Latency, SSE, mars-over-fcfs goals and mars against the relay (the goal point and the
    # one-call sessions) are measured; those against nginx/LiteLLM are not. (A measured goal's
    # verdict may still be None: a negative added latency is noise; the ratio to the relay is
    # None when the relay's own added latency was not above zero in that round.)
    assert len(measured) >= 10, goals
    assert {g["limit"] for k, g in goals.items() if "aiohttp-relay" in k} == {1.25}
    assert all(g["met"] is None for k, g in goals.items() if "LiteLLM" in k or "nginx" in k)
    assert result["machine"]["cpus"] >= 1
    assert "| goal |" in out.with_suffix(".md").read_text()
