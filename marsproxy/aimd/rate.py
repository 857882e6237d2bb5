"""Admission rate and the ``Retry-After`` it implies.

A client told to come back should be told when a slot is likely: the sessions ahead of it
divided by how fast sessions are being admitted. The rate is an exponentially weighted count
over an exponentially weighted time, so it follows load changes within a few half-lives and
does not jump with every tick.

After a quiet spell the estimate is low, so the advice errs long and more of the queue counts
as critical (see :mod:`marsproxy.aimd.order_index`) until admissions pick up again.

Pure code: no I/O; ``now`` is a parameter.
"""

from __future__ import annotations

import math


class AdmissionRate:
    """Exponentially weighted admissions per second."""

    def __init__(self, halflife_s: float) -> None:
        if halflife_s <= 0:
            raise ValueError(f"halflife_s must be positive, got {halflife_s}")
        self.halflife_s = halflife_s
        self._count = 0.0  # decayed admissions
        self._span = 0.0  # decayed seconds observed
        self._last: float | None = None

    def _advance(self, now: float) -> None:
        if self._last is None:
            self._last = now
            return
        dt = max(0.0, now - self._last)
        self._last = max(self._last, now)
        if dt == 0.0:
            return
        decay = 0.5 ** (dt / self.halflife_s)
        self._count *= decay
        # ∫ of the decay weight over the elapsed interval: the time just observed, discounted.
        self._span = self._span * decay + self.halflife_s / math.log(2) * (1.0 - decay)

    def record(self, now: float, admitted: int = 0) -> None:
        """Note ``admitted`` admissions at ``now`` (call with 0 to let time pass)."""
        self._advance(now)
        self._count += admitted

    def per_second(self, now: float) -> float | None:
        """Admissions per second; ``None`` before any time has been observed."""
        self._advance(now)
        if self._span <= 0.0:
            return None
        return self._count / self._span


def retry_after_s(ahead: int, rate: float | None, lo: int, hi: int) -> int:
    """Whole seconds until ``ahead`` sessions are admitted at ``rate``, clamped to [lo, hi]."""
    if rate is None or rate <= 0.0:
        return hi  # nothing is moving: the longest advice is the honest one
    return max(lo, min(hi, math.ceil(max(1, ahead) / rate)))
