"""CpuProbe against this machine's real PSI files while CPU burners run.

PSI's cumulative ``total`` (microseconds of stall) is asserted rather than ``avg10``: the kernel
updates averages every 2 s, so a short burn may not show in them yet, while ``total`` moves at
once. Burners outnumber CPUs two to one, so some task is always waiting while they run.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from marsproxy.probes.cpu import (
    HOST_PSI_PATH,
    SOURCE_CGROUP_PSI,
    SOURCE_CGROUP_STAT,
    SOURCE_HOST_PSI,
    SOURCE_PSUTIL,
    CpuProbe,
    parse_psi,
    usable_cpu_count,
)

BURN_S = 3.0
# Stall the burners must cause: with 2× as many burners as CPUs, "some" stall accrues at about
# wall-clock speed, so 0.3 s of it is reached early and far above background noise.
STALL_US = 300_000


def host_psi_works() -> bool:
    try:
        return parse_psi(Path(HOST_PSI_PATH).read_text()).some is not None
    except OSError:
        return False


def cgroup2_root() -> Path | None:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] == "cgroup2":
            return Path(parts[1])
    return None


@contextmanager
def burners(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    code = f"import time\nend = time.monotonic() + {BURN_S}\nwhile time.monotonic() < end: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def stall_rises(read_total: Callable[[], int | None]) -> tuple[int, int]:
    """Poll until the stall counter rose by STALL_US or the burn is over; (before, after)."""
    before = read_total()
    assert before is not None
    after = before
    end = time.monotonic() + BURN_S
    while time.monotonic() < end and after - before < STALL_US:
        time.sleep(0.05)
        after = read_total() or after
    return before, after


@pytest.mark.skipif(not host_psi_works(), reason="no PSI in /proc/pressure/cpu on this kernel")
def test_host_psi_total_rises_under_cpu_burn() -> None:
    # The host counter also moves with everything else on the machine (other test runs), so
    # compare the stall rate during the burn with the rate just before it.
    probe = CpuProbe()
    assert probe.sources == (SOURCE_HOST_PSI,)

    def total() -> int:
        v = probe.read().psi_some_total_us
        assert v is not None
        return v

    t0, s0 = time.monotonic(), total()
    time.sleep(0.5)
    base_rate = (total() - s0) / (time.monotonic() - t0)  # stall µs per second
    if base_rate > 400_000:
        pytest.skip(f"host already stalls {base_rate / 1e4:.0f}% of the time: cannot tell")
    with burners(max(2, 2 * usable_cpu_count())):
        t1 = time.monotonic()
        before, after = stall_rises(total)
        burn_rate = (after - before) / (time.monotonic() - t1)
    assert after - before >= STALL_US
    assert burn_rate > 2 * base_rate


@pytest.mark.skipif(host_psi_works(), reason="PSI present; the fallback is tested with fakes")
def test_without_psi_the_psutil_fallback_is_chosen() -> None:
    probe = CpuProbe()
    assert probe.sources == (SOURCE_PSUTIL,)
    r = probe.read()
    assert r.cpu_percent is not None and 0.0 <= r.cpu_percent <= 100.0


@pytest.fixture
def cgroup() -> Iterator[Path]:
    root = cgroup2_root()
    if root is None:
        pytest.skip("no cgroup v2 hierarchy mounted")
    path = root / f"marsproxy-probe-test-{os.getpid()}"
    try:
        path.mkdir()
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EPERM, errno.EACCES):
            pytest.skip(f"cannot create a cgroup under {root}: {exc.strerror}")
        raise
    try:
        yield path
    finally:
        # The burners have exited (and been reaped), so the cgroup is empty and can go.
        for _ in range(50):
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.02)


def test_cgroup_psi_total_rises_when_its_tasks_burn(cgroup: Path) -> None:
    probe = CpuProbe(str(cgroup))
    assert SOURCE_CGROUP_PSI in probe.sources and SOURCE_CGROUP_STAT in probe.sources
    assert probe.read().psi_some_total_us == 0  # a new cgroup has stalled for nothing yet
    n = max(2, 2 * usable_cpu_count())
    with burners(n) as procs:
        try:
            for p in procs:
                (cgroup / "cgroup.procs").write_text(str(p.pid))
        except OSError as exc:
            pytest.skip(f"cannot move processes into {cgroup}: {exc.strerror}")
        before, after = stall_rises(lambda: probe.read().psi_some_total_us)
    assert after - before >= STALL_US
