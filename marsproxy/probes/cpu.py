"""CPU pressure where tools run: cgroup v2 files, else host PSI, else psutil.

Sources, best first, chosen once at start and listed in :attr:`CpuProbe.sources`:

1. a cgroup v2 directory (``probes.cpu.cgroup_path``): ``cpu.pressure`` (PSI),
   ``cpu.stat`` (throttling), ``cpu.max`` (quota);
2. the host's ``/proc/pressure/cpu`` (PSI);
3. ``psutil.cpu_percent`` (utilization, no stall information).

Units: PSI ``avg10``/``avg60``/``avg300`` are PERCENT of wall time (0..100) in which at least
one runnable task waited for a CPU ("some"); ``total`` is cumulative stall time in
microseconds. ``throttled_usec`` is microseconds; ``cpu_percent`` is 0..100 of all CPUs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from marsproxy.probes.config import CpuProbeConfig

log = logging.getLogger(__name__)

HOST_PSI_PATH = "/proc/pressure/cpu"

SOURCE_CGROUP_PSI = "cgroup:cpu.pressure"
SOURCE_CGROUP_STAT = "cgroup:cpu.stat"
SOURCE_CGROUP_MAX = "cgroup:cpu.max"
SOURCE_HOST_PSI = "host:/proc/pressure/cpu"
SOURCE_PSUTIL = "psutil"


@dataclass(frozen=True, slots=True)
class PsiLine:
    avg10: float
    """Percent (0..100) of the last 10 s with stalled tasks."""
    avg60: float
    avg300: float
    total_us: int
    """Cumulative stall time, microseconds."""


@dataclass(frozen=True, slots=True)
class Psi:
    some: PsiLine | None
    full: PsiLine | None


@dataclass(frozen=True, slots=True)
class CpuStat:
    usage_usec: int | None = None
    nr_periods: int | None = None
    nr_throttled: int | None = None
    throttled_usec: int | None = None


def parse_psi(text: str) -> Psi:
    """Parse a PSI file (``cpu.pressure`` or ``/proc/pressure/cpu``).

    ``some avg10=4.17 avg60=2.79 avg300=1.45 total=10854113``; a ``full`` line may follow
    (kernels before 5.13 have none for CPU). Malformed lines are skipped.
    """
    lines: dict[str, PsiLine] = {}
    for raw in text.splitlines():
        kind, _, rest = raw.strip().partition(" ")
        if kind not in ("some", "full"):
            continue
        fields = dict(part.partition("=")[::2] for part in rest.split())
        try:
            lines[kind] = PsiLine(
                avg10=float(fields["avg10"]),
                avg60=float(fields["avg60"]),
                avg300=float(fields["avg300"]),
                total_us=int(fields["total"]),
            )
        except (KeyError, ValueError):
            continue
    return Psi(some=lines.get("some"), full=lines.get("full"))


def parse_cpu_stat(text: str) -> CpuStat:
    """Parse cgroup v2 ``cpu.stat`` (``key value`` lines); throttling keys exist only when the
    cpu controller is enabled for the cgroup, so each field may be ``None``."""
    values: dict[str, int] = {}
    for raw in text.splitlines():
        parts = raw.split()
        if len(parts) == 2:
            try:
                values[parts[0]] = int(parts[1])
            except ValueError:
                continue
    return CpuStat(
        usage_usec=values.get("usage_usec"),
        nr_periods=values.get("nr_periods"),
        nr_throttled=values.get("nr_throttled"),
        throttled_usec=values.get("throttled_usec"),
    )


def parse_cpu_max(text: str) -> float | None:
    """Parse cgroup v2 ``cpu.max`` (``$QUOTA $PERIOD``) into CPUs; ``max ...`` (no limit) or
    anything unreadable gives ``None``."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    try:
        quota = int(parts[0])
        period = int(parts[1]) if len(parts) > 1 else 100_000  # the kernel's default period
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


@dataclass(frozen=True, slots=True)
class CpuPressure:
    """One reading; fields from sources that are absent are ``None``."""

    sampled_at: float
    source: str
    """Where the pressure figure came from (one of the ``SOURCE_*`` names)."""
    psi_some_avg10: float | None = None
    """Percent 0..100."""
    psi_some_avg60: float | None = None
    psi_some_total_us: int | None = None
    psi_full_avg10: float | None = None
    nr_throttled: int | None = None
    throttled_usec: int | None = None
    quota_cpus: float | None = None
    cpu_percent: float | None = None
    """psutil, percent 0..100 of all CPUs since the previous reading (fallback only)."""
    tool_cpus: float = 0.0


def usable_cpu_count() -> int:
    """CPUs this process may run on (affinity), which is what containers restrict."""
    return len(os.sched_getaffinity(0))


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None


class CpuProbe:
    """Reads CPU pressure from the best source found at construction (logged once)."""

    def __init__(
        self,
        cgroup_path: str = "",
        *,
        tool_cpus: float = 0.0,
        host_psi_path: str = HOST_PSI_PATH,
        clock: Callable[[], float] = time.monotonic,
        cpu_percent: Callable[[], float] | None = None,
        cpu_count: Callable[[], int] = usable_cpu_count,
    ) -> None:
        self._clock = clock
        self._cpu_percent = cpu_percent or (lambda: psutil.cpu_percent(interval=None))
        self._cgroup = Path(cgroup_path) if cgroup_path else None
        self._host_psi = Path(host_psi_path)
        found: list[str] = []
        notes: list[str] = []
        if self._cgroup is not None:
            for source, name in (
                (SOURCE_CGROUP_PSI, "cpu.pressure"),
                (SOURCE_CGROUP_STAT, "cpu.stat"),
                (SOURCE_CGROUP_MAX, "cpu.max"),
            ):
                if _read(self._cgroup / name) is not None:
                    found.append(source)
            if SOURCE_CGROUP_PSI not in found:
                notes.append(f"no readable {self._cgroup / 'cpu.pressure'}")
        if SOURCE_CGROUP_PSI not in found:
            text = _read(self._host_psi)
            if text is not None and parse_psi(text).some is not None:
                found.append(SOURCE_HOST_PSI)
            else:
                notes.append(f"no PSI at {self._host_psi}")
                found.append(SOURCE_PSUTIL)
                # The first psutil call only sets the baseline (it returns 0.0).
                self._cpu_percent()
        self.sources: tuple[str, ...] = tuple(found)

        quota = None
        if SOURCE_CGROUP_MAX in found and self._cgroup is not None:
            quota = parse_cpu_max(_read(self._cgroup / "cpu.max") or "")
        if tool_cpus > 0:
            self.tool_cpus, how = tool_cpus, "config"
        elif quota is not None:
            self.tool_cpus, how = quota, "cgroup cpu.max"
        else:
            self.tool_cpus, how = float(cpu_count()), "usable CPUs"
        log.info(
            "CPU probe sources: %s; tool_cpus=%g (%s)%s",
            ", ".join(self.sources),
            self.tool_cpus,
            how,
            "; " + "; ".join(notes) if notes else "",
        )

    @classmethod
    def from_config(
        cls, cfg: CpuProbeConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> CpuProbe:
        return cls(cfg.cgroup_path, tool_cpus=cfg.tool_cpus, clock=clock)

    def read(self) -> CpuPressure:
        """One reading: a few small file reads. Never raises; a vanished file gives ``None``s."""
        now = self._clock()
        if SOURCE_CGROUP_PSI in self.sources and self._cgroup is not None:
            source, psi_text = SOURCE_CGROUP_PSI, _read(self._cgroup / "cpu.pressure")
        elif SOURCE_HOST_PSI in self.sources:
            source, psi_text = SOURCE_HOST_PSI, _read(self._host_psi)
        else:
            source, psi_text = SOURCE_PSUTIL, None
        psi = parse_psi(psi_text) if psi_text is not None else Psi(None, None)
        stat = CpuStat()
        quota = None
        if self._cgroup is not None:
            if SOURCE_CGROUP_STAT in self.sources:
                stat = parse_cpu_stat(_read(self._cgroup / "cpu.stat") or "")
            if SOURCE_CGROUP_MAX in self.sources:
                quota = parse_cpu_max(_read(self._cgroup / "cpu.max") or "")
        return CpuPressure(
            sampled_at=now,
            source=source,
            psi_some_avg10=psi.some.avg10 if psi.some else None,
            psi_some_avg60=psi.some.avg60 if psi.some else None,
            psi_some_total_us=psi.some.total_us if psi.some else None,
            psi_full_avg10=psi.full.avg10 if psi.full else None,
            nr_throttled=stat.nr_throttled,
            throttled_usec=stat.throttled_usec,
            quota_cpus=quota,
            cpu_percent=self._cpu_percent() if source == SOURCE_PSUTIL else None,
            tool_cpus=self.tool_cpus,
        )
