"""Forecast peak contexts of admitted sessions, for the KV-fit check
(``admission.tuning.kv_fit_peak``).

An agent's context grows after admission: every call appends the previous reply and the tool
output (trace p50: a 13k first prompt grows to a 53k peak). A KV-fit on the first prompt alone
admits sessions whose *later* contexts no longer fit together, and a window cannot take back
what it admitted, so the engine preempts and recomputes. Here each admitted session — running
or in a tool phase — is budgeted at its forecast peak

    forecast = max(context so far, min(first prompt × G, the worker's max_model_len))

where G, the growth factor, is the ratio Σ peak / Σ first prompt over recently finished
sessions (a ratio of sums: the budget is a sum over sessions, so the aggregate growth is what
counts, and one session with a tiny first prompt cannot dominate it). Until enough sessions
have finished, G is the configured prior; a session of a tenant whose sessions do not return
(``core/returns.py``) will not grow: its G is 1. A worker's *peak room* is its usable blocks
less the forecast of every session admitted on it, expressed in first-prompt blocks (÷ G), so
the queue's existing fit check (the first prompt's blocks against a budget) tests the forecast.
No context outgrows the longest the worker serves (its ``max_model_len``, where reported): an
admitted session's forecast never exceeds it.

Pure code: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(slots=True)
class _Session:
    worker: str
    first: int
    """First prompt in tokens: the estimate until the worker reports the real count."""
    context: int
    """Largest context seen so far (prompt + reply of its calls)."""
    observed: bool = False
    held: bool = True
    """Counted in the worker's committed forecasts (false: dormant past its KV hold)."""
    grows: bool = True
    """Forecast to grow by G (false: its tenant's sessions are known not to return)."""

    def peak(self, growth: float, cap: int | None = None) -> int:
        grown = math.ceil(self.first * growth) if self.grows else self.first
        return max(self.context, grown if cap is None else min(grown, cap))


class PeakForecast:
    """Per-session forecast peaks and the growth factor learnt from finished sessions."""

    def __init__(self, prior_growth: float, history: int, min_samples: int) -> None:
        if prior_growth < 1:
            raise ValueError(f"prior_growth must be ≥ 1, got {prior_growth}")
        self.prior_growth = prior_growth
        self.min_samples = min_samples
        self._done: deque[tuple[int, int]] = deque(maxlen=history)  # (first, peak)
        self._sum_first = 0
        self._sum_peak = 0
        self._sessions: dict[str, _Session] = {}
        # Worker → its sessions whose KV is held: the forecasts' sums walk these alone, not
        # every open session (a plain client's may number thousands, dormant past their hold).
        self._held: dict[str, dict[str, _Session]] = {}
        self._growing: dict[str, int] = {}  # worker → how many of those are forecast to grow
        self._caps: dict[str, int] = {}  # worker → the longest context it serves (tokens)

    def limit(self, worker: str, max_tokens: int | None) -> None:
        """The longest context ``worker`` serves (its ``max_model_len``; ``None``: not
        reported): no forecast there exceeds it."""
        if max_tokens is None or max_tokens <= 0:
            self._caps.pop(worker, None)
        else:
            self._caps[worker] = max_tokens

    # -- sessions -------------------------------------------------------------------------
    def admit(self, session: str, worker: str, est_tokens: int, *, grows: bool = True) -> None:
        """``session`` is admitted on ``worker`` with a first prompt of about ``est_tokens``;
        ``grows``: false where it is known to end after its call (no growth forecast)."""
        est = max(0, est_tokens)
        self._unhold(session)
        s = self._sessions[session] = _Session(worker, est, est, held=False, grows=grows)
        self._hold(session, s)

    def move(self, session: str, worker: str) -> None:
        s = self._sessions.get(session)
        if s is not None:
            held = s.held
            self._unhold(session)
            s.worker = worker
            if held:
                self.hold(session)

    def back(self, session: str) -> None:
        """``session`` sent another call: its forecast counts (again, if it was dormant past
        its hold), and it grows, whatever its tenant's record said when it was admitted (a key
        misread as one-shot while its first tools ran)."""
        s = self._sessions.get(session)
        if s is not None and not s.grows:
            self._unhold(session)  # held again below, counted as growing
            s.grows = True
        self.hold(session)

    def release(self, session: str) -> None:
        """``session`` stayed dormant past its KV hold: its forecast stops counting."""
        self._unhold(session)

    def hold(self, session: str) -> None:
        """``session`` is back (a request): its forecast counts again."""
        s = self._sessions.get(session)
        if s is not None and not s.held:
            self._hold(session, s)

    def _hold(self, session: str, s: _Session) -> None:
        s.held = True
        self._held.setdefault(s.worker, {})[session] = s
        if s.grows:
            self._growing[s.worker] = self._growing.get(s.worker, 0) + 1

    def _unhold(self, session: str) -> None:
        s = self._sessions.get(session)
        if s is not None and s.held:
            s.held = False
            self._held[s.worker].pop(session, None)
            if s.grows:
                self._growing[s.worker] -= 1

    def observe(self, session: str, prompt_tokens: int, completion_tokens: int = 0) -> None:
        """A call of ``session`` finished with these token counts (its context now)."""
        s = self._sessions.get(session)
        if s is None or prompt_tokens <= 0:
            return
        if not s.observed:
            s.first = prompt_tokens  # the real first prompt replaces the estimate
            s.observed = True
        s.context = max(s.context, prompt_tokens + max(0, completion_tokens))

    def end(self, session: str, *, finished: bool) -> None:
        """``session`` ends; a session that ran to its final call teaches the growth."""
        self._unhold(session)
        s = self._sessions.pop(session, None)
        if s is None or not finished or not s.observed or s.first <= 0:
            return
        if len(self._done) == self._done.maxlen:
            f, p = self._done[0]
            self._sum_first -= f
            self._sum_peak -= p
        self._done.append((s.first, s.context))
        self._sum_first += s.first
        self._sum_peak += s.context

    # -- forecasts --------------------------------------------------------------------------
    def growth(self) -> float:
        """G: peak context per first-prompt token (the prior until ``min_samples`` finished)."""
        if len(self._done) < max(1, self.min_samples) or self._sum_first <= 0:
            return self.prior_growth
        return max(1.0, self._sum_peak / self._sum_first)

    def forecast(self, session: str) -> int:
        """Forecast peak context of an admitted session in tokens (0: unknown session)."""
        s = self._sessions.get(session)
        return 0 if s is None else s.peak(self.growth(), self._caps.get(s.worker))

    def one_shot(self, session: str) -> bool:
        """Whether ``session`` is admitted and forecast not to grow (its tenant's sessions do
        not come back: it holds no KV past its call)."""
        s = self._sessions.get(session)
        return s is not None and not s.grows

    def flat_tokens(self, worker: str) -> int:
        """Σ forecasts of the sessions holding KV on ``worker`` that are not forecast to grow
        (one-shot tasks in their call)."""
        cap = self._caps.get(worker)
        return sum(s.peak(1.0, cap) for s in self._held.get(worker, {}).values() if not s.grows)

    def flat_only(self, worker: str) -> bool:
        """Whether sessions hold KV on ``worker`` and none of them is forecast to grow (one-shot
        tasks only: no returning session's KV there to protect)."""
        return bool(self._held.get(worker)) and not self._growing.get(worker, 0)

    def held_on(self, worker: str) -> list[str]:
        """The sessions admitted on ``worker`` whose KV is held."""
        return list(self._held.get(worker, ()))

    def committed_tokens(self, worker: str, elsewhere: int = 0, *,
                         without: Callable[[str], bool] | None = None) -> int:
        """Sum of the forecast peaks of the sessions admitted on ``worker`` whose KV is held
        (in a call, or dormant within their hold; ``without``: less those it is true of), plus
        ``elsewhere`` sessions other replicas hold there, each counted at the typical forecast:
        the mean of this replica's sessions on that worker, else the mean peak of finished
        sessions. One-shot tasks are left out: they hold KV only in their call, which the
        engine's queue serves as with no proxy (as the window's KV reading leaves them out)."""
        g, cap = self.growth(), self._caps.get(worker)
        mine = [s.peak(g, cap) for k, s in self._held.get(worker, {}).items()
                if s.grows and not (without and without(k))]
        total = sum(mine)
        if elsewhere > 0:
            if mine:
                typical = total / len(mine)
            elif self._done:
                typical = self._sum_peak / len(self._done)
            else:
                typical = 0.0  # nothing known yet: the free-block budget still applies
            total += math.ceil(elsewhere * typical)
        return total

    def resident_committed_tokens(
        self, worker: str, blocks_of: Mapping[str, int], block_size: int, elsewhere: int = 0,
    ) -> int:
        """:meth:`committed_tokens` from a worker's KV index: each held session counts its
        resident blocks (``blocks_of``, by session) plus its forecast growth (forecast peak
        less its context so far); one whose first prompt was not served yet, its forecast.
        Blocks two sessions share (a common system prompt) count once, for whichever session
        stored them. ``elsewhere`` sessions of other replicas count at this worker's mean.
        One-shot tasks are left out (:meth:`committed_tokens`)."""
        g, cap = self.growth(), self._caps.get(worker)
        total = n = 0
        for key, s in self._held.get(worker, {}).items():
            if not s.grows:
                continue
            peak = s.peak(g, cap)
            n += 1
            if not s.observed:
                total += peak
            else:
                total += blocks_of.get(key, 0) * block_size + peak - s.context
        if elsewhere > 0 and n:
            total += math.ceil(elsewhere * total / n)
        return total

    def room_blocks(
        self, committed_tokens: int, total_blocks: int, block_size: int, reserve_frac: float,
        overcommit: float = 1.0, growth: float | None = None,
    ) -> int:
        """Blocks of *first prompt* a new session may have on a worker whose admitted sessions'
        forecasts sum to ``committed_tokens`` (:meth:`committed_tokens`), so that its forecast
        peak fits beside them: (usable × overcommit − committed blocks) ÷ G (may be negative).
        Its own forecast is not capped here: a pass admits several sessions against one room,
        each taking its first prompt's blocks, so the room stays in first-prompt units."""
        usable = math.floor(overcommit * (total_blocks - math.ceil(reserve_frac * total_blocks)))
        committed = math.ceil(committed_tokens / block_size)
        return math.floor((usable - committed) / (growth or self.growth()))

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session: object) -> bool:
        return session in self._sessions
