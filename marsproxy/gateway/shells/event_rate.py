"""Tool events per session: a token bucket per session key (pure; the clock is a parameter).

Each session may post ``burst`` events at once and ``rate`` per second on average. Buckets that
have refilled are dropped (a full bucket is the same as none), so memory follows the sessions
that post fast, not all sessions ever seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    at: float


class EventRate:
    def __init__(self, rate_per_s: float, burst: int) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError(f"need rate_per_s > 0 and burst >= 1, got {rate_per_s}, {burst}")
        self.rate, self.burst = rate_per_s, float(burst)
        self._buckets: dict[str, _Bucket] = {}
        self._next_prune = 0.0

    def take(self, key: str, now: float) -> float:
        """Spend one token for ``key``: 0.0 if allowed, else seconds until one is available."""
        self._prune(now)
        b = self._buckets.get(key)
        tokens = self.burst if b is None else min(self.burst, b.tokens + (now - b.at) * self.rate)
        if tokens < 1.0:
            if b is not None:
                b.tokens, b.at = tokens, now
            return (1.0 - tokens) / self.rate
        if b is None:
            self._buckets[key] = _Bucket(tokens - 1.0, now)
        else:
            b.tokens, b.at = tokens - 1.0, now
        return 0.0

    @staticmethod
    def retry_after_s(wait_s: float) -> int:
        """A ``Retry-After`` value (whole seconds, at least 1) for a wait."""
        return max(1, math.ceil(wait_s))

    def __len__(self) -> int:
        return len(self._buckets)

    def _prune(self, now: float) -> None:
        # At most once per refill period: drop the buckets that are full again by now.
        if now < self._next_prune:
            return
        refill_s = self.burst / self.rate
        self._next_prune = now + refill_s
        for key in [k for k, b in self._buckets.items() if now - b.at >= refill_s]:
            del self._buckets[key]
