"""How much of their forecast peaks admitted sessions hold at once, measured per worker.

The forecast-peak fit (``aimd/peak.py``) budgets every admitted session at its peak as if all
peaked together. Whether they do depends on the workload: sessions whose tool phases are long
hold little KV between calls (vLLM frees a paused session's blocks into its prefix cache), and
a session reaches its peak only at its last calls. The engine shows what they hold: its used
blocks (plus what the proxy's ledger retains) against the sum of their forecasts. That ratio
is the *overlap*; the fit may then overcommit by ``peak_overlap_target / overlap`` (so that
what the admitted sessions are seen to hold stays below that share of the usable blocks),
between ``peak_overcommit`` and ``peak_overcommit_max``.

Caution, because an overlap measured early (sessions at their first prompts) is low and rises
as they grow, and a few sessions overlap by chance:

- it is read only while the worker holds at least ``peak_overlap_min_sessions`` sessions and
  their forecasts fill at least ``peak_overlap_min_fill`` of its usable blocks (a nearly empty
  worker says nothing about how sessions overlap at the fit's limit); a worker that never
  qualifies keeps ``peak_overcommit``;
- it is a decaying maximum that starts at 1 (no overcommit) and halves once per *session
  lifetime* (the mean time admitted of the last ``peak_history`` sessions that ran their
  course) of qualifying readings, so it forgets a high reading only once the sessions that
  produced it are gone, and not at all before the first session has finished or gone quiet
  past its KV hold (a plain client's sessions end only at their idle timeout, a minute on);
- a rise of the engine's preemption counter resets it to 1, and a worker that reports no
  such counter is never read (no overcommit without that safety net); a rise while one-shot
  tasks run there does not: vLLM preempts the latest-started calls first, a batch stream's, and
  such a stream keeps the engine preempting whatever the sessions that return hold (read as
  the fit's fault, it held a few agents beside a batch client to the strict fit: their new
  sessions waited seconds for room the engine had).

Pure code: no I/O, no clock (``now`` is a parameter).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from marsproxy.aimd.config import AdmissionConfig


@dataclass(slots=True)
class _Worker:
    overlap: float = 1.0
    last_now: float | None = None
    preemptions: float | None = None


class OverlapTracker:
    """Per worker overlap of forecast peaks, and the overcommit it allows."""

    def __init__(self, cfg: AdmissionConfig, workers: Sequence[str]) -> None:
        self.floor = cfg.tuning.peak_overcommit
        self.ceiling = max(cfg.tuning.peak_overcommit, cfg.tuning.peak_overcommit_max)
        self.target = cfg.tuning.peak_overlap_target
        self.min_sessions = cfg.tuning.peak_overlap_min_sessions
        self.min_fill = cfg.tuning.peak_overlap_min_fill
        self._workers = {w: _Worker() for w in workers}
        self._lives: deque[float] = deque(maxlen=cfg.tuning.peak_history)
        self._sum_lives = 0.0
        # Whether a session's client reported a tool of it still running (the control plane
        # sets the tool tracker's; alone, nobody reports one).
        self.in_reported_tool: Callable[[str], bool] = lambda session: False

    def factor(self, worker: str) -> float:
        """The overcommit the fit may use on ``worker`` now."""
        o = self.overlap(worker)
        if o * self.ceiling <= self.target:  # also an overlap decayed to 0: no division
            return self.ceiling
        return max(self.floor, self.target / o)

    def overlap(self, worker: str) -> float:
        return self._workers[worker].overlap

    @property
    def lifetime_s(self) -> float | None:
        """Mean time admitted of the recent sessions that ran their course."""
        return self._sum_lives / len(self._lives) if self._lives else None

    def went_quiet(self, session: str, admitted_at: float | None, last_active: float) -> None:
        """``session``, admitted at ``admitted_at``, stayed dormant past its KV hold after its
        last request at ``last_active``: while no session has run its course, it counts as one
        that did (it is likely done, as the hold assumes), so that the decay starts. Not while
        its client reports a tool of it running: that task goes on, and its time so far would
        pace the decay far too fast (300 sessions at 32k: 737 s mean against 771 s)."""
        if not self._lives and admitted_at is not None and not self.in_reported_tool(session):
            self.session_lived(last_active - admitted_at)

    def session_lived(self, seconds: float) -> None:
        """A session ran its course after ``seconds`` admitted: the decay's pace."""
        if len(self._lives) == self._lives.maxlen:
            self._sum_lives -= self._lives[0]
        self._lives.append(max(0.0, seconds))
        self._sum_lives += self._lives[-1]

    def observe(
        self, now: float, worker: str, *, used_blocks: int, committed_blocks: int,
        usable_blocks: int, sessions: int, preemptions_total: float | None,
        tasks: bool = False,
    ) -> None:
        """A control tick's reading of one worker: the blocks its engine holds (with the
        ledger's), the admitted sessions' forecasts in blocks, its usable blocks, how many
        sessions it holds, its preemption counter, and whether one-shot tasks run there."""
        w = self._workers[worker]
        last, w.last_now = w.last_now, now
        prev, w.preemptions = w.preemptions, preemptions_total
        # A counter that went down is a restarted engine: a new baseline, not a preemption.
        if (not tasks and prev is not None and preemptions_total is not None
                and preemptions_total > prev):
            w.overlap = 1.0
            return
        if preemptions_total is None:
            return  # no safety net: an engine that cannot say it preempts gets no overcommit
        if (sessions < self.min_sessions or usable_blocks <= 0
                or committed_blocks < self.min_fill * usable_blocks):
            return  # too few sessions, or too little committed, to say how they overlap
        life = self.lifetime_s
        if last is not None and life:
            w.overlap *= 0.5 ** (max(0.0, now - last) / life)
        w.overlap = max(w.overlap, used_blocks / committed_blocks)
