"""The tool-CPU signal the admission core reads, honest about where tools run.

A proxy sees tool phases two ways: reported by the agent harness (``POST
/mars/v1/sessions/{id}/events``), or inferred from the gap between a session's calls. An
inferred gap is a tool on the probed host only where tools run there and the host shows it: a
plain client between two one-shot tasks, or an agent whose tools run in a sandbox on another
machine (the usual Kubernetes setup), leaves gaps that cost this host nothing. So
``tools.location`` says where tools run:

- ``host`` (default): on the probed host or cgroup. Reported phases always count; inferred
  phases count only while the measured pressure confirms CPU work (PSI some avg10 at or above
  ``tools.tuning.confirm_psi``, the cgroup throttled since the previous reading, or without
  either source the CPUs busy at or above ``tools.tuning.confirm_cpu_percent``). PSI feeds the
  controller too (``admission.tuning.use_psi``).
- ``reported``: only what harnesses report counts; the host's pressure is not the tools'.
- ``elsewhere``: nothing counts; tool CPU never holds sessions back. Phases are still tracked
  for tool-time predictions (idle timeouts, KV retention).

Pure code: fed readings and the tracker, no I/O; ``now`` is a parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from marsproxy.config import ToolsConfig
from marsproxy.probes.cpu import CpuPressure
from marsproxy.probes.tool_phases import ToolPhaseTracker, ToolTrackerSettings


class ToolLocation(StrEnum):
    HOST = "host"
    REPORTED = "reported"
    ELSEWHERE = "elsewhere"


@dataclass(frozen=True, slots=True)
class ToolCpuSignals:
    """What one control tick reads of tool CPU (the same for every worker)."""

    tools_in_flight: int = 0
    backlog_ratio: float = 0.0
    tool_wait_ema_s: float = 0.0
    psi_some_avg10: float | None = None
    inferred_counted: bool = False
    """Whether inferred tool phases counted (measured pressure confirmed them)."""


class ToolCpuSignal:
    """Turns the tracker and the CPU probe's readings into :class:`ToolCpuSignals`."""

    def __init__(self, location: ToolLocation | str, confirm_psi: float,
                 confirm_cpu_percent: float) -> None:
        self.location = ToolLocation(location)
        self.confirm_psi = confirm_psi
        self.confirm_cpu_percent = confirm_cpu_percent
        self._last: CpuPressure | None = None
        self._throttling = False
        self.confirmed = False
        """Whether the last reading confirmed CPU work on the probed host."""

    def observe(self, reading: CpuPressure | None) -> None:
        """A CPU probe reading (the same one may come again: it is only counted once)."""
        if reading is None or reading is self._last:
            return
        last, self._last = self._last, reading
        if reading.nr_throttled is not None and last is not None and last.nr_throttled is not None:
            self._throttling = reading.nr_throttled > last.nr_throttled
        self.confirmed = self._confirms(reading)

    def _confirms(self, r: CpuPressure) -> bool:
        if r.psi_some_avg10 is not None:
            return r.psi_some_avg10 >= self.confirm_psi or self._throttling
        if self._throttling:
            return True
        return r.cpu_percent is not None and r.cpu_percent >= self.confirm_cpu_percent

    def signals(self, tracker: ToolPhaseTracker, now: float) -> ToolCpuSignals:
        loc = self.location
        if loc is ToolLocation.ELSEWHERE:
            return ToolCpuSignals()
        if loc is ToolLocation.REPORTED:
            return ToolCpuSignals(
                tools_in_flight=tracker.explicit_in_flight,
                backlog_ratio=tracker.backlog_ratio(now, inferred=False),
                tool_wait_ema_s=tracker.queue_wait_ema,
            )
        counted = self.confirmed
        return ToolCpuSignals(
            tools_in_flight=tracker.in_flight if counted else tracker.explicit_in_flight,
            backlog_ratio=tracker.backlog_ratio(now, inferred=counted),
            tool_wait_ema_s=tracker.queue_wait_ema,
            psi_some_avg10=None if self._last is None else self._last.psi_some_avg10,
            inferred_counted=counted,
        )


def tool_plane(cfg: ToolsConfig, tool_cpus: float) -> tuple[ToolPhaseTracker, ToolCpuSignal]:
    """The tool-phase tracker and the tool-CPU signal as ``tools:`` configures them, for
    ``tool_cpus`` CPUs: built here once for the gateway and the simulator."""
    t = cfg.tuning
    tracker = ToolPhaseTracker(ToolTrackerSettings(
        ema_alpha=t.ema_alpha, quantile=t.quantile, history=t.history, tool_cpus=tool_cpus,
        inferred_min_s=t.inferred_min_s,
    ))
    return tracker, ToolCpuSignal(cfg.location, t.confirm_psi, t.confirm_cpu_percent)
