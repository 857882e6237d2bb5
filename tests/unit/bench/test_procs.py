"""Process helpers of the benchmarks: CPU use of the host and of one process, measured."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from marsproxy.bench.cpuwork import burn_cpu
from marsproxy.bench.procs import cpu_mark, cpu_since

# Burns 0.5 s of its own CPU, then waits (on its stdin) until killed.
_BURN_THEN_WAIT = ("import sys, time\nt = time.process_time()\n"
                   "while time.process_time() - t < 0.5: pass\nsys.stdin.read()")


@pytest.fixture
def waiting_child() -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    yield child
    child.kill()
    child.wait()


def test_a_process_that_burns_cpu_shows_as_its_own_busy_cores_within_the_hosts() -> None:
    child = subprocess.Popen([sys.executable, "-c", _BURN_THEN_WAIT], stdin=subprocess.PIPE)
    try:
        start = cpu_mark(child.pid)
        assert start.process_s is not None
        deadline = time.monotonic() + 20
        while (cpu_mark(child.pid).process_s or 0) - start.process_s < 0.4:
            assert time.monotonic() < deadline, "the child burnt no CPU"
            time.sleep(0.05)
        used = cpu_since(start, child.pid)
    finally:
        child.kill()
        child.wait()
    proc = used["process_cores"]
    assert proc is not None and proc * used["wall_s"] >= 0.35
    # the host's count holds the child's (its clock ticks are coarser: 10 ms)
    assert used["host_busy_cores"] * used["wall_s"] >= proc * used["wall_s"] - 0.05
    assert 0 < used["host_busy_cores"] <= used["cores"]
    # gone: nothing to say about it any more
    assert cpu_since(start, child.pid)["process_cores"] is None


def test_another_process_burning_is_the_hosts_not_the_waiting_ones(
        waiting_child: subprocess.Popen[bytes]) -> None:
    mark = cpu_mark(waiting_child.pid)
    asyncio.run(burn_cpu(0.4))
    used = cpu_since(mark, waiting_child.pid)
    assert used["process_cores"] is not None and used["process_cores"] * used["wall_s"] < 0.05
    assert used["host_busy_cores"] * used["wall_s"] >= 0.3


def test_without_a_process_only_the_host_is_measured() -> None:
    mark = cpu_mark()
    assert mark.process_s is None
    used = cpu_since(mark)
    assert used["process_cores"] is None and used["wall_s"] >= 0
