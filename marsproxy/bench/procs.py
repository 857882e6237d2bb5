"""Helpers for running marsproxy commands as subprocesses (end-to-end tests, benchmarks)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

CLI = (sys.executable, "-m", "marsproxy.cli")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now. Bind-then-close can race with another process taking
    it; on a test machine that is rare, and :func:`wait_up` then fails clearly."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def http_status(url: str, timeout_s: float = 2.0) -> int:
    """HTTP status of ``GET url``; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Wait until ``GET url`` answers 200; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        if http_status(url) == 200:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not come up in {timeout_s} s")
