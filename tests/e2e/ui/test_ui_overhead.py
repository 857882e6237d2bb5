"""The overhead benchmark's ``+pages`` targets: a proxy measured while five emulated
``/mars/ui`` pages poll its state (and, ``+pages-events``, read its event stream), real
subprocesses and wrk."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(
    shutil.which("wrk") is None, reason="wrk is not installed (.ci/run installs it)"
)


def test_overhead_benchmark_runs_with_pages_open(tmp_path: Path) -> None:
    out, work = tmp_path / "result.json", tmp_path / "work"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead" / "run.py"),
         "--targets", "direct,marsproxy-mars+pages,marsproxy-mars+pages-events", "--points", "tiny",
         "--duration", "2", "--warmup", "0", "--rounds", "1", "--out", str(out),
         "--workdir", str(work)],
        cwd=ROOT, capture_output=True, timeout=180, check=False,
    )
    assert done.returncode == 0, done.stdout.decode()[-2000:] + done.stderr.decode()[-2000:]
    rows = {(s["point"], s["target"]): s for s in json.loads(out.read_text())["summary"]}
    for point in ("ns-r200-c4", "sse-max-c2"):
        for target in ("marsproxy-mars+pages", "marsproxy-mars+pages-events"):
            s = rows[(point, target)]
            assert s["requests"] > 0 and s["errors"] == 0, s
    # The pages really read, no errors: state documents only by default (the page's default,
    # live events off), state documents and event bytes with --events.
    for target, mode, events in (("marsproxy-mars+pages", "state only", False),
                                 ("marsproxy-mars+pages-events", "state and events", True)):
        log = (work / f"{target}-pages.log").read_text()
        m = re.search(rf"pages 5 \({mode}\): (\d+) state documents, (\d+) event bytes,"
                      r" (\d+) errors", log)
        assert m is not None, log
        assert int(m.group(1)) >= 5 and m.group(3) == "0", log
        assert (int(m.group(2)) > 0) == events, log
