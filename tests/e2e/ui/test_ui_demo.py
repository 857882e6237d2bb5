"""`marsproxy demo` names the page's URL and serves it while ``--linger`` runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

SMALL = ["--sessions", "2", "--calm-sessions", "1", "--max-turns", "2",
         "--tool-time-scale", "0.01", "--time-scale", "0.2", "--no-compare"]


def test_demo_prints_the_page_and_serves_it_while_lingering() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "marsproxy.cli", "demo", *SMALL, "--linger", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "the demo ended before lingering:\n" + "".join(lines)
            lines.append(line)
            if line.startswith("replay done; keeping the proxy up"):
                break
        out = "".join(lines)
        m = re.search(r"watch it live: (http://127\.0\.0\.1:\d+/mars/ui) in a browser", out)
        assert m is not None, out
        assert m.group(1) in lines[-1]  # named again while it lingers
        with urllib.request.urlopen(m.group(1), timeout=10) as r:
            assert r.status == 200 and "<title>marsproxy</title>" in r.read().decode()
        state_url = m.group(1).replace("/mars/ui", "/mars/v1/state")
        with urllib.request.urlopen(state_url, timeout=10) as r:
            assert [w["name"] for w in json.load(r)["workers"]] == ["w0", "w1"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
