"""Fixtures shared by the integration tests: a private redis-server tests may kill, and the
``gpu`` mark (tests skipped where NVML sees no GPU, as in CI).

The shared Redis on 127.0.0.1:6379 is never stopped; outage tests start their own server on a
free port in a temporary directory.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from marsproxy.bench.procs import RedisServer


def _gpu_count() -> int:
    try:
        import pynvml
    except ImportError:  # nvidia-ml-py not installed: no GPU to test
        return 0
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver: no GPU
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if marked and _gpu_count() == 0:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason="NVML sees no GPU on this host"))


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
