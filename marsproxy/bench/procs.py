"""Helpers for running marsproxy commands as subprocesses (end-to-end tests, benchmarks)."""

from __future__ import annotations

import shutil
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


class RedisServer:
    """A redis-server of one's own on a free loopback port, without persistence.

    For the demo's replica mode and the end-to-end tests: never the shared Redis. ``kill``
    drops its data (like a crashed pod); ``start`` again reuses the port.
    """

    def __init__(self, workdir: str) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = workdir
        self._proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    def start(self, timeout_s: float = 5.0) -> None:
        self._proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self._proc.poll() is not None:
                break
            time.sleep(0.01)
        self.kill()
        raise RuntimeError(f"redis-server did not listen on {self.port}")

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
