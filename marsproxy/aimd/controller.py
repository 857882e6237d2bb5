"""The AIMD admission window of one worker, with hysteresis and caps.

Two overload state machines (KV and tool CPU) each enter at a high mark and leave at a low
mark, so a pressure that hovers between the marks neither grows nor shrinks the window. While
KV is overloaded the window shrinks multiplicatively on every control tick; CPU overload holds
it (an overloaded CPU wastes no work, it stretches tool phases, and the sessions that overloaded
it stay admitted, so a cut every tick would walk the window to ``window_min`` long before any of
them leaves) and lets the CPU cap bound the limit. The window grows by a constant only when both
pressures are below their low marks, the KV budget is positive and the window is actually used.

Work conservation: the window counts sessions only while the worker is overloaded (KV, tool
CPU, or unseen). Without overload the number of admitted sessions never holds anybody back: the
KV fit (each admitted session budgeted at its forecast peak) decides, up to ``window_max`` where
the operator set one. So sessions idle between calls keep their KV budget but no slot that
blocks others. The KV cap takes the limit to ``window_min`` the moment usage reaches the high
mark, without waiting for the window to walk down. The CPU cap counts sessions, not tools (a
session in an LLM call uses no tool CPU), so it binds only while tool-CPU pressure is above its
low marks (overloaded, or in the band on the way up).

Pure code: no I/O; ``now`` is a parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from marsproxy.aimd.config import AdmissionConfig
from marsproxy.core.events import WindowChange

# Float sums of the interval (0.2 + 0.2 + ...) land a hair short of the boundary; without a
# tolerance every other tick would be skipped. The same holds for 0.7·W landing a hair below
# an integer it equals.
_EPS = 1e-9
# The ceiling without ``window_max``: no count bound (the KV fit bounds what fits). A number, not
# None, because limits travel as integers (the store's records, the state document, metrics).
NO_CEILING = 1 << 20


@dataclass(frozen=True, slots=True)
class ControlSignals:
    """One worker's inputs to a control tick, all from the information stream."""

    kv_usage: float | None = None
    """KV usage 0..1; ``None``: unknown, treated as full (fail closed)."""
    stale: bool = False
    """No fresh sample: treated as full KV (fail closed)."""
    free_blocks: int | None = None
    budget_blocks: int | None = None
    """Blocks a new session may use (core.kv.kv_budget); ``None``: the worker reports no blocks."""
    tools_in_flight: int = 0
    backlog_ratio: float = 0.0
    tool_wait_ema_s: float = 0.0
    psi_some_avg10: float | None = None
    tool_cpus: float = 0.0
    """CPUs for tools; 0: unknown, no CPU cap."""
    admitted: int = 0
    """Sessions admitted on this worker now (for the app-limited guard)."""


class AimdController:
    """Window, caps and overload states of one worker."""

    def __init__(self, cfg: AdmissionConfig, worker: str = "") -> None:
        self.cfg = cfg
        self.worker = worker
        self._window = cfg.window_init
        self._ceiling = cfg.window_max if cfg.window_max is not None else NO_CEILING
        self._kv_cap = self._ceiling
        self._cpu_cap = self._ceiling
        self._kv_over = False
        self._cpu_over = False
        self._stale = False
        self._seen = False  # a tick with the worker's facts has run
        self._last_tick: float | None = None

    # -- state ----------------------------------------------------------------------------
    @property
    def window(self) -> int:
        return self._window

    @property
    def kv_cap(self) -> int:
        return self._kv_cap

    @property
    def cpu_cap(self) -> int:
        return self._cpu_cap

    @property
    def ceiling(self) -> int:
        """Sessions this worker may ever hold: ``window_max``, else :data:`NO_CEILING`."""
        return self._ceiling

    @property
    def overloaded(self) -> bool:
        """Whether the window binds now: KV or tool CPU overloaded, or the worker unseen."""
        return self._kv_over or self._cpu_over or self._stale

    @property
    def effective_limit(self) -> int:
        """Sessions this worker may hold now: the ceiling bounded by both caps and, while it is
        overloaded, by the window."""
        limit = min(self._ceiling, self._kv_cap, self._cpu_cap)
        return min(limit, self._window) if self.overloaded else limit

    def slot_limit(self, quiet: int, limit: int | None = None) -> int:
        """``limit`` (:attr:`effective_limit` if not given) in slots, where ``quiet`` of the
        sessions holding one are dormant past their KV hold (likely done, as the hold
        assumes): the window and the caps bound the sessions that hold KV room or may add tool
        work, and those hold neither; only ``window_max`` counts them (a plain client's
        finished sessions keep slots for kv_hold_min_s: counted, they kept a CPU-overloaded
        worker shut while its engine idled)."""
        limit = self.effective_limit if limit is None else limit
        return limit if limit >= self._ceiling else min(self._ceiling, limit + quiet)

    @property
    def idle_limit(self) -> int:
        """The limit for an idle admission (``admission.tuning.idle_admit``): without the window and
        the CPU cap while KV is healthy. The CPU cap binds on tool-CPU overload, which an
        engine with nothing to run does not add to until the admitted session's call is done."""
        if self._kv_over or self._stale:
            return self.effective_limit
        return min(self._kv_cap, self._ceiling)

    @property
    def kv_overloaded(self) -> bool:
        return self._kv_over

    @property
    def cpu_overloaded(self) -> bool:
        return self._cpu_over

    @property
    def stale(self) -> bool:
        return self._stale

    @property
    def seen(self) -> bool:
        """Whether a tick with the worker's facts has run (before: held at the floor)."""
        return self._seen

    @property
    def last_tick(self) -> float | None:
        return self._last_tick

    # -- the control tick -------------------------------------------------------------------
    def tick(self, now: float, signals: ControlSignals) -> list[WindowChange]:
        """Run one control step if ``control_interval_s`` has passed since the last one, or
        at once when the worker was unseen (stale) and is seen now.

        Returns the window changes (at most one) to publish; empty when skipped or held.
        """
        cfg = self.cfg
        last = self._last_tick
        stale = signals.stale or signals.kv_usage is None
        early = last is not None and now < last + cfg.tuning.control_interval_s - _EPS
        # The interval paces the window's steps. A worker unseen at the last tick (before its
        # first scrape) and seen now gets its caps from the facts at once, or it would sit at
        # the floor for a whole interval; its window's next step still waits for the interval.
        back = self._stale and not stale
        if early and not back:
            return []
        if not early:
            self._last_tick = now
        self._stale = stale
        self._seen = self._seen or not stale
        usage = 1.0 if self._stale else float(signals.kv_usage or 0.0)
        self._update_kv(usage)
        self._update_cpu(signals)
        self._kv_cap = self._kv_cap_for(usage)
        # Above the low marks the CPUs are measurably pressed: more sessions in tools would
        # overload them, so the cap binds in the band as well as in overload.
        pressed = self._cpu_over or not self._cpu_below_leave(signals)
        self._cpu_cap = self._cpu_cap_for(signals.tool_cpus) if pressed else self._ceiling
        # Never seen yet (before the first scrape): the floor holds it, and nothing was
        # measured that the window could step on. A worker seen before that goes stale is cut.
        if early or not self._seen:
            return []

        old = self._window
        reason = ""
        if self._kv_over:
            self._window = max(cfg.window_min, math.floor(cfg.tuning.decrease * old + _EPS))
            reason = self._overload_reason()
        elif self._may_grow(usage, signals):
            self._window = min(self._ceiling, old + cfg.tuning.increase)
            reason = "additive_increase"
        if self._window == old:
            return []
        return [
            WindowChange(ts=now, worker=self.worker, old=old, new=self._window, reason=reason)
        ]

    def _update_kv(self, usage: float) -> None:
        if self._kv_over:
            self._kv_over = usage > self.cfg.tuning.kv_leave
        else:
            self._kv_over = usage >= self.cfg.tuning.kv_enter

    def _update_cpu(self, s: ControlSignals) -> None:
        cfg = self.cfg
        # PSI joins only when configured and reported; a host without PSI is not overloaded.
        psi = s.psi_some_avg10 if cfg.tuning.use_psi else None
        if self._cpu_over:
            self._cpu_over = not self._cpu_below_leave(s)
        else:
            self._cpu_over = (
                s.backlog_ratio >= cfg.tuning.cpu_backlog_enter
                or s.tool_wait_ema_s >= cfg.tuning.tool_wait_enter_s
                or (psi is not None and psi >= cfg.tuning.psi_enter)
            )

    def _cpu_below_leave(self, s: ControlSignals) -> bool:
        cfg = self.cfg
        psi = s.psi_some_avg10 if cfg.tuning.use_psi else None
        return (
            s.backlog_ratio <= cfg.tuning.cpu_backlog_leave
            and s.tool_wait_ema_s <= cfg.tuning.tool_wait_leave_s
            and (psi is None or psi <= cfg.tuning.psi_leave)
        )

    def _may_grow(self, usage: float, s: ControlSignals) -> bool:
        cfg = self.cfg
        if usage > cfg.tuning.kv_leave or not self._cpu_below_leave(s):
            return False  # inside a hysteresis band: hold
        # A worker that reports no blocks has only its usage gauge to go by, checked above.
        if s.budget_blocks is not None and s.budget_blocks <= 0:
            return False
        # App-limited guard: an unused window proves nothing about capacity.
        return s.admitted >= cfg.tuning.app_limited_frac * self._window

    def _overload_reason(self) -> str:
        parts = []
        if self._kv_over:
            parts.append("stale" if self._stale else "kv_overload")
        if self._cpu_over:
            parts.append("cpu_overload")
        return "+".join(parts)

    def _kv_cap_for(self, usage: float) -> int:
        # Between the marks the KV fit's reserve keeps new prompts below the high mark; at it,
        # only the floor is let in until the window has walked down.
        return self.cfg.window_min if usage >= self.cfg.tuning.kv_enter else self._ceiling

    def _cpu_cap_for(self, tool_cpus: float) -> int:
        cfg = self.cfg
        if tool_cpus <= 0:
            return self._ceiling
        cap = math.ceil(tool_cpus * cfg.tuning.cpu_cap_backlog - _EPS)
        return max(cfg.window_min, min(self._ceiling, cap))
