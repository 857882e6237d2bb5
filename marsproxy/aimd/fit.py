"""What the admission core knows of each worker's KV: the budgets, the forecast-peak fit and the
views the queue places by.

:class:`WorkerFit` is the part of :class:`marsproxy.aimd.admission.AdmissionCore` that reads the
workers' signals and the sessions' forecasts and decides nothing: how many blocks a new session
may use on a worker (free blocks less the reserve, the retained and the promised blocks, bounded
by the room the forecast peaks leave), the overcommit the fit uses, how long a worker has idled,
and the :class:`~marsproxy.aimd.queue.WorkerView` of each worker.

Pure code: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from marsproxy.aimd.config import AdmissionConfig
from marsproxy.aimd.controller import AimdController, ControlSignals
from marsproxy.aimd.gauge import GaugeLag
from marsproxy.aimd.overlap import OverlapTracker
from marsproxy.aimd.peak import PeakForecast
from marsproxy.aimd.queue import WorkerView
from marsproxy.aimd.yields import Yields
from marsproxy.core.kv import blocks_for_tokens, kv_budget
from marsproxy.core.lifecycle import SessionLifecycle

DEFAULT_BLOCK_SIZE = 16  # vLLM's default, for workers that do not report cache_config_info


@dataclass(frozen=True, slots=True)
class WorkerSignals:
    """One worker's latest pressure, as the probes report it."""

    healthy: bool = True
    stale: bool = False
    kv_usage: float | None = None
    free_blocks: int | None = None
    total_blocks: int | None = None
    block_size: int | None = None
    retained_blocks: int = 0
    """Blocks the proxy reserved for retained dormant sessions (the scheduler's KV ledger)."""
    sessions_elsewhere: int = 0
    """Sessions other replicas hold on this worker (the shared store's leases less ours): the
    forecast-peak fit counts them at the typical forecast, as it cannot see their contexts."""
    running: int | None = None
    """Requests the engine runs now (vLLM's running gauge); ``None``: not reported."""
    preemptions_total: float | None = None
    """The engine's preemption counter (vLLM's ``num_preemptions_total``); ``None``: not
    reported."""
    prefill_tokens_per_s: float | None = None
    """The engine's measured prefill speed (the scraper's estimate); ``None``: not known yet."""
    sampled_at: float | None = None
    """When the engine's gauges were read, on the core's clock (``None``: unknown)."""
    tools_in_flight: int = 0
    backlog_ratio: float = 0.0
    tool_wait_ema_s: float = 0.0
    psi_some_avg10: float | None = None
    tool_cpus: float = 0.0
    max_model_len: int | None = None
    """The longest context the worker serves (``None``: not reported): the forecasts' cap."""
    session_blocks: Mapping[str, int] | None = None
    """Resident blocks per session from the worker's KV index (``None``: no usable index):
    the forecast-peak fit counts these instead of the measured overlap."""


class WorkerFit:
    """The KV views of the admission core (its base: the state is the core's)."""

    cfg: AdmissionConfig
    workers: tuple[str, ...]
    controllers: dict[str, AimdController]
    sessions: SessionLifecycle
    peaks: PeakForecast
    yields: Yields
    overlaps: OverlapTracker
    _signals: dict[str, WorkerSignals]
    gauge: GaugeLag

    def budget(self, worker: str, committed_tokens: int | None = None) -> int | None:
        """KV blocks a new session may use on ``worker`` (``None``: no block counts);
        ``committed_tokens``: the forecasts' sum there, when the caller has it."""
        return _smaller(self.free_budget(worker), self.peak_room(worker, committed_tokens))

    def free_budget(self, worker: str) -> int | None:
        """KV blocks free on ``worker`` now for a new session's first prompt, less the reserve,
        the retained and the promised blocks: the budget without the forecast-peak fit."""
        s = self._signals[worker]
        if s.stale:
            return 0
        if s.free_blocks is None or s.total_blocks is None:
            return None
        return kv_budget(s.free_blocks, s.total_blocks, self.cfg.kv_reserve_frac,
                         s.retained_blocks) + self._lag(worker)

    def idle_s(self, now: float, worker: str) -> float | None:
        """How long ``worker`` has run nothing while every session admitted on it sits in a
        tool phase (``None``: something runs, nothing is admitted, or it cannot be known)."""
        s = self._signals[worker]
        if s.stale:
            return None
        since = self.sessions.dormant_since(worker)
        if since is None:
            return None
        if (s.running or 0) > 0 or (s.running is None and s.sessions_elsewhere > 0):
            # Something runs there (other replicas' or anyone's requests), unless the gauge
            # was read before this replica's last call ended and no one else holds sessions
            # there: then it still counted that call, and it is the one that is over.
            earlier = s.sampled_at is not None and s.sampled_at < since
            if not earlier or s.sessions_elsewhere > 0:
                return None
        return max(0.0, now - since)

    def peak_room(self, worker: str, committed_tokens: int | None = None) -> int | None:
        """With ``kv_fit_peak``: first-prompt blocks a new session on ``worker`` may have so
        that its forecast peak fits beside the forecasts of the sessions admitted there
        (``None``: off, the worker reports no block counts, or it holds fewer than
        ``peak_free_sessions``); ``committed_tokens``: those forecasts' sum, when the caller
        has it. A worker with a KV index counts each session's resident blocks plus its
        forecast growth instead."""
        fit = self._fit_tokens(worker, committed_tokens)
        return None if fit is None else self._room(worker, fit, self.peak_factor(worker, fit))

    def _fit_tokens(self, worker: str, committed_tokens: int | None = None) -> int | None:
        """What the forecast-peak fit counts on ``worker`` (see :meth:`peak_room`)."""
        s = self._signals[worker]
        if not self.cfg.tuning.kv_fit_peak or s.total_blocks is None:
            return None
        held = self.sessions.admitted_on(worker) + s.sessions_elsewhere
        if held < self.cfg.tuning.peak_free_sessions:
            return None
        if s.session_blocks is not None:  # KV events: what each session really holds
            # The same overcommit as the estimate's: peaks that do not coincide (measured
            # overlap, cheap preemption); without it the fit admitted less (twins 1.59× vs 1.69×).
            return self.peaks.resident_committed_tokens(
                worker, s.session_blocks, s.block_size or DEFAULT_BLOCK_SIZE,
                s.sessions_elsewhere)
        if committed_tokens is None:
            committed_tokens = self.peaks.committed_tokens(worker, s.sessions_elsewhere)
        return committed_tokens

    def _room(self, worker: str, fit_tokens: int, factor: float) -> int:
        s = self._signals[worker]
        assert s.total_blocks is not None  # _fit_tokens gave a count: the worker has blocks
        return self.peaks.room_blocks(fit_tokens, s.total_blocks,
                                      s.block_size or DEFAULT_BLOCK_SIZE,
                                      self.cfg.kv_reserve_frac, factor)

    def protected_room(self, worker: str) -> int | None:
        """The KV budget on ``worker`` of a session that would yield to nobody, while sessions
        that yield hold KV there (``yields.py``; ``None``: none do, or no forecast fit): the
        forecast-peak fit against the sessions that do not yield alone."""
        s = self._signals[worker]
        if (self.yields.nobody() or s.stale or not self.cfg.tuning.kv_fit_peak
                or s.total_blocks is None):
            return None
        held = self.peaks.held_on(worker)
        yielding = {k for k in held if self.yields.yields(k)}  # each session judged once
        if not yielding:
            return None
        kept = len(held) - len(yielding)
        bs = s.block_size or DEFAULT_BLOCK_SIZE
        committed = self.peaks.committed_tokens(worker, s.sessions_elsewhere,
                                                without=yielding.__contains__)
        if kept + s.sessions_elsewhere < self.cfg.tuning.peak_free_sessions:
            # As the forecast fit of a worker with few sessions: the first prompt fits beside
            # what the others are forecast to hold, its own growth not asked for.
            return self.peaks.room_blocks(committed, s.total_blocks, bs,
                                          self.cfg.kv_reserve_frac, growth=1.0)
        return self.peaks.room_blocks(committed, s.total_blocks, bs, self.cfg.kv_reserve_frac,
                                      self.peak_factor(worker, committed))

    def peak_factor(self, worker: str, committed_tokens: int | None = None) -> float:
        """The overcommit the forecast-peak fit uses on ``worker`` now: the measured overlap's
        (``overlap.py``), or ``peak_overcommit_max`` while a preemption there is cheap (see
        :meth:`reprefill_s`) and fewer than ``peak_cheap_sessions`` sessions are in a call
        (those of other replicas count as in a call: this replica cannot see them)."""
        factor = self.overlaps.factor(worker)
        return self.overlaps.ceiling if self.cheap_slots(worker, committed_tokens) else factor

    def cheap_slots(self, worker: str, committed_tokens: int | None = None) -> int:
        """Sessions the cheap-preemption ceiling may let in on ``worker`` now: as many as
        bring its sessions in a call to ``peak_cheap_sessions`` (0: the ceiling does not apply,
        the measured overlap's factor rules). Each one admitted goes into a call, so a pass
        that let in more on the ceiling would break the premise it was granted on: a drained
        worker took 8 at once on the twins, then preempted. That holds also below
        ``peak_free_sessions`` held, where the pass skips the forecast fit. The views cap the
        pass's count by these; the core then runs the fit without the ceiling for the rest."""
        limit = self.cfg.tuning.peak_cheap_reprefill_s
        if (limit <= 0 or not self.cfg.tuning.kv_fit_peak
                or self._signals[worker].total_blocks is None
                or self.overlaps.factor(worker) >= self.overlaps.ceiling):
            return 0
        # The count first (an index lookup); the price sums the worker's forecasts.
        in_call = self.sessions.active_on(worker) + self._signals[worker].sessions_elsewhere
        slots = max(0, self.cfg.tuning.peak_cheap_sessions - in_call)
        if not slots:
            return 0
        reprefill = self.reprefill_s(worker, committed_tokens)
        return slots if reprefill is not None and reprefill <= limit else 0

    def capped(self, views: list[WorkerView]) -> bool:
        """Whether the cheap ceiling capped the count of any of these views (the sessions it
        let in are in a call now: the fit without it decides on the rest)."""
        return any(v.limit < self.slot_limit(v.name) for v in views)

    def slot_limit(self, worker: str, limit: int | None = None) -> int:
        """The worker's ``limit`` (its effective limit if not given) in slots: sessions dormant
        past a KV hold cut short keep a slot but are outside the window and the caps
        (``AimdController.slot_limit``)."""
        return self.controllers[worker].slot_limit(self.sessions.lapsed_on(worker), limit)

    def reprefill_s(self, worker: str, committed_tokens: int | None = None) -> float | None:
        """Seconds ``worker`` takes to re-prefill the mean forecast peak of the sessions held
        there, at its measured prefill speed: what a preemption costs it (``None``: no session
        held, or no speed measured yet)."""
        s = self._signals[worker]
        held = self.sessions.admitted_on(worker) + s.sessions_elsewhere
        speed = s.prefill_tokens_per_s
        if held <= 0 or speed is None or speed <= 0 or s.stale:
            return None
        if committed_tokens is None:
            committed_tokens = self.peaks.committed_tokens(worker, s.sessions_elsewhere)
        return committed_tokens / held / speed

    def _observe_overlap(self, now: float, worker: str, committed_tokens: int) -> None:
        s = self._signals[worker]
        if (not self.cfg.tuning.kv_fit_peak or s.stale or not s.total_blocks
                or s.free_blocks is None):
            return
        usable = s.total_blocks - math.ceil(self.cfg.kv_reserve_frac * s.total_blocks)
        committed = math.ceil(committed_tokens / (s.block_size or DEFAULT_BLOCK_SIZE))
        tasks = self._task_blocks(worker)
        # What the sessions that return hold: one-shot tasks' calls are left out of both sides.
        used = max(0, s.total_blocks - s.free_blocks + s.retained_blocks - tasks)
        self.overlaps.observe(now, worker, used_blocks=used, committed_blocks=committed,
                              usable_blocks=usable,
                              sessions=self.sessions.admitted_on(worker) + s.sessions_elsewhere,
                              preemptions_total=s.preemptions_total, tasks=tasks > 0)

    def _free(self, worker: str) -> int | None:
        # Free blocks as the load balancer should see them: the gauge's, corrected by its lag.
        s = self._signals[worker]
        if s.stale:
            return 0
        return None if s.free_blocks is None else s.free_blocks + self._lag(worker)

    def _lag(self, worker: str) -> int:
        """Blocks freed since the gauge was read, less those promised (``gauge.py``)."""
        return self.freed_blocks(worker) - self.gauge.promised_on(worker)

    def freed_blocks(self, worker: str) -> int:
        """Blocks of calls the gauge's reading counted that have ended since (``gauge.py``)."""
        s = self._signals[worker]
        used = 0 if s.total_blocks is None or s.free_blocks is None else (
            s.total_blocks - s.free_blocks)
        return self.gauge.freed_on(worker, used)

    def promised(self) -> tuple[int, int]:
        """(sessions, blocks) promised to admitted sessions whose first prompt the worker has
        not served yet (all workers)."""
        return self.gauge.promised()

    def views(self, now: float | None = None) -> list[WorkerView]:
        return self._views(now)

    def all_stale(self) -> bool:
        """Whether nothing is known of any worker (each view would read ``stale``)."""
        return all(s.stale for s in self._signals.values())

    def _control_signals(self, w: str, committed_tokens: int) -> ControlSignals:
        s = self._signals[w]
        return ControlSignals(
            kv_usage=self.kv_signal(w), stale=s.stale, free_blocks=s.free_blocks,
            budget_blocks=self.budget(w, committed_tokens), tools_in_flight=s.tools_in_flight,
            backlog_ratio=s.backlog_ratio, tool_wait_ema_s=s.tool_wait_ema_s,
            psi_some_avg10=s.psi_some_avg10, tool_cpus=s.tool_cpus,
            admitted=self.sessions.load_on(w),
        )

    def _flat_only(self, worker: str) -> bool:
        """Only this replica's one-shot tasks hold KV on ``worker`` (``PeakForecast.flat_only``;
        no other replica's sessions, no retained KV)."""
        s = self._signals[worker]
        return not s.sessions_elsewhere and not s.retained_blocks and self.peaks.flat_only(worker)

    def kv_signal(self, worker: str) -> float | None:
        """The KV usage the AIMD controller reads: the KV of the sessions that return.
        max(vLLM's gauge, (used + retained blocks) / total): vLLM counts the cached blocks of a
        session in its tool phase as free, the ledger knows they will be wanted back; less the
        blocks of one-shot tasks in their call, and 0 where only those hold KV
        (``PeakForecast.flat_only``): a cache full of calls that never return is the engine's
        own queue at work, as with no proxy, and a window cut would only hold sessions back."""
        s = self._signals[worker]
        u = s.kv_usage
        if u is None:
            return None
        if self._flat_only(worker):
            return 0.0
        if not s.total_blocks or s.free_blocks is None:
            return u
        if s.retained_blocks > 0:
            used = s.total_blocks - s.free_blocks
            u = max(u, min(1.0, (used + s.retained_blocks) / s.total_blocks))
        tasks = self._task_blocks(worker)
        return max(0.0, u - tasks / s.total_blocks) if tasks else u

    def _task_blocks(self, worker: str) -> int:
        """KV blocks of the one-shot tasks in their call on ``worker`` (their forecasts)."""
        bs = self._signals[worker].block_size or DEFAULT_BLOCK_SIZE
        return blocks_for_tokens(self.peaks.flat_tokens(worker), bs)

    def _views(self, now: float | None = None) -> list[WorkerView]:
        out = []
        for w in self.workers:
            s, c = self._signals[w], self.controllers[w]
            # Each once: the forecast's room sums over every session on the worker.
            # The ceiling once for the room and the count: its price sums the forecasts.
            fit = self._fit_tokens(w)
            cheap = self.cheap_slots(w, fit)
            factor = self.overlaps.ceiling if cheap else self.overlaps.factor(w)
            free, peak = self.free_budget(w), None if fit is None else self._room(w, fit, factor)
            admitted, limit = self.sessions.load_on(w), self.slot_limit(w)
            if cheap:  # the ceiling's room is for these few: the pass takes no more
                limit = min(limit, admitted + cheap)
            out.append(WorkerView(
                name=w, admitted=admitted, limit=limit,
                healthy=s.healthy, stale=s.stale, budget_blocks=_smaller(free, peak),
                free_blocks=self._free(w), retained_blocks=s.retained_blocks,
                peak_room_blocks=peak,
                block_size=s.block_size or DEFAULT_BLOCK_SIZE, total_blocks=s.total_blocks,
                long_admitted=self.sessions.long_on(w), in_call=self.sessions.active_on(w),
                kv_overloaded=c.kv_overloaded, cpu_overloaded=c.cpu_overloaded,
                idle_s=None if now is None else self.idle_s(now, w),
                free_budget_blocks=free, idle_limit=self.slot_limit(w, c.idle_limit),
                protected_budget_blocks=self.protected_room(w),
                placed=self.sessions.placed_on(w),
            ))
        return out


def _smaller(free: int | None, peak: int | None) -> int | None:
    """The budget: the free-block budget, bounded by the forecast's room where there is one."""
    return free if free is None or peak is None else min(free, peak)
