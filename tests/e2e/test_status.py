"""`marsproxy status` against a real stack: two `marsproxy emulate` workers behind
`marsproxy serve`, each a subprocess, and the status command run as one too."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from marsproxy.bench.procs import CLI as PROC_CLI
from marsproxy.bench.procs import free_port, stop_all, wait_up

CLI = list(PROC_CLI)
WORKERS = ("alpha", "beta")








@pytest.fixture
def proxy_url(tmp_path: Path) -> Iterator[str]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        worker_urls = []
        for _ in WORKERS:
            port = free_port()
            p = subprocess.Popen(
                [*CLI, "emulate", "--profile", "tiny", "--port", str(port), "--time-scale", "0.05"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            procs.append(p)
            worker_urls.append(f"http://127.0.0.1:{port}")
            wait_up(f"{worker_urls[-1]}/health", p)
        cfg = tmp_path / "marsproxy.yaml"
        named = zip(worker_urls, WORKERS, strict=True)
        cfg.write_text("workers:\n" + "".join(f"  - {{url: '{u}', name: {n}}}\n" for u, n in named))
        port = free_port()
        p = subprocess.Popen(
            [*CLI, "serve", "--config", str(cfg), "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        procs.append(p)
        url = f"http://127.0.0.1:{port}"
        wait_up(f"{url}/readyz", p)
        yield url
    finally:
        stop_all(procs)


def _chat(url: str, model: str, session: str) -> None:
    body = json.dumps({
        "model": model, "max_tokens": 4,
        "messages": [{"role": "user", "content": f"hello from {session}"}],
    }).encode()
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", data=body, method="POST",
        headers={"Content-Type": "application/json", "x-session-id": session},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "status", *args], capture_output=True, text=True, timeout=30, check=False,
        # A wide "terminal" (output is a pipe), and no MARSPROXY_URL from the caller's shell.
        env={**{k: v for k, v in os.environ.items() if k != "MARSPROXY_URL"}, "COLUMNS": "200"},
    )


def test_status_names_both_workers(proxy_url: str) -> None:
    # Give the stream something to report: a few sessions spread over the workers.
    with urllib.request.urlopen(f"{proxy_url}/v1/models", timeout=10) as r:
        model = json.load(r)["data"][0]["id"]
    for i in range(4):
        _chat(proxy_url, model, f"e2e-status-{i}")

    r = _status("--url", proxy_url)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert out.startswith("marsproxy ")
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    for name in WORKERS:
        assert name in rows, out
        assert rows[name].split()[1] == "ok", out
    assert "Sessions  total" in out and "Events    published" in out

    r = _status("--url", proxy_url, "--sessions")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "e2e-status-0" in r.stdout, r.stdout


def test_status_of_a_stopped_proxy_fails_cleanly() -> None:
    r = _status("--url", f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 1
    assert r.stdout == ""
    assert r.stderr.startswith("marsproxy status: cannot reach marsproxy at ")
    assert r.stderr.count("\n") == 1
