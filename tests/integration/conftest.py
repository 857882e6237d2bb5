"""Fixtures shared by the integration tests: a private redis-server tests may kill.

The shared Redis on 127.0.0.1:6379 is never stopped; outage tests start their own server on a
free port in a temporary directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from marsproxy.bench.procs import free_port


class PrivateRedis:
    """A redis-server of the test's own: kill it, pause it, start it again on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = workdir
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self._dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.01)
        raise RuntimeError(f"redis-server did not listen on {self.port}")

    def kill(self) -> None:
        """SIGKILL: the data is gone (no persistence), like a crashed Redis pod."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def pause(self) -> None:
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGCONT)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()  # SIGKILL ends a paused (SIGSTOP) server too
