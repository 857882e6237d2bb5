"""Least attained service (``priority_policy: las``): a session is demoted one level per service
threshold it passes, so one long session cannot starve many short ones, and a waiting
continuation is promoted one level per aging period, so nothing starves.

Pure code: no I/O, no clock; the caller passes how long the continuation has waited.
"""

from __future__ import annotations

import math
from bisect import bisect_left

from marsproxy.sched.config import SchedulerConfig

LOWEST = 3  # the last las level; the highest number, the least urgent


def demotion(attained_service: float, cfg: SchedulerConfig) -> int:
    """Levels lost for attained service: one per threshold strictly passed."""
    return bisect_left(cfg.tuning.service_thresholds, attained_service)


def promotion(waited_s: float, cfg: SchedulerConfig) -> int:
    """Levels gained by waiting: one per whole aging period."""
    if waited_s <= 0:
        return 0
    return math.floor(waited_s / cfg.tuning.aging_period_s)


def service_of(
    cfg: SchedulerConfig, prompt_tokens: int, completion_tokens: int, engine_s: float
) -> float:
    """One continuation's service in the configured measure (tokens or engine seconds)."""
    if cfg.tuning.service_measure == "engine_seconds":
        return max(0.0, engine_s)
    return float(max(0, prompt_tokens) + max(0, completion_tokens))


class SessionService:
    """Attained service per session, the input of least-attained-service demotion."""

    def __init__(self) -> None:
        self._attained: dict[str, float] = {}

    def add(self, session: str, amount: float) -> float:
        """Adds one continuation's service; returns the session's new total."""
        if amount < 0:
            raise ValueError(f"service must not be negative, got {amount}")
        total = self._attained.get(session, 0.0) + amount
        self._attained[session] = total
        return total

    def attained(self, session: str) -> float:
        return self._attained.get(session, 0.0)

    def forget(self, session: str) -> None:
        """Drops a finished session so the table does not grow without bound."""
        self._attained.pop(session, None)

    def __len__(self) -> int:
        return len(self._attained)
