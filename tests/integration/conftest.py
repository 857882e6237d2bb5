"""Fixtures shared by the integration tests: a private redis-server tests may kill.

The shared Redis on 127.0.0.1:6379 is never stopped; outage tests start their own server on a
free port in a temporary directory.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from marsproxy.bench.procs import RedisServer


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()  # SIGKILL ends a paused (SIGSTOP) server too
