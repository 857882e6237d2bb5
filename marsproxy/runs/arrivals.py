"""Session arrival processes: Poisson at a rate, a fixed rate, or bursts. Seeded.

``rate_per_s`` is sessions per second (Poisson, fixed) or bursts per second (burst). A rate of 0
means every session (or every burst) arrives at time 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

ArrivalKind = Literal["poisson", "fixed", "burst"]


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    kind: ArrivalKind = "poisson"
    rate_per_s: float = 1.0
    burst_size: int = 8

    def __post_init__(self) -> None:
        if self.kind not in ("poisson", "fixed", "burst"):
            raise ValueError(f"unknown arrival kind {self.kind!r}; use poisson, fixed or burst")
        if self.rate_per_s < 0:
            raise ValueError("rate_per_s must be >= 0")
        if self.burst_size < 1:
            raise ValueError("burst_size must be >= 1")

    def label(self) -> str:
        if self.kind == "burst":
            return f"burst {self.burst_size} @ {self.rate_per_s:g}/s"
        return f"{self.kind} {self.rate_per_s:g}/s"


def arrival_times(spec: ArrivalSpec, n: int, rng: random.Random) -> list[float]:
    """``n`` non-decreasing arrival times in seconds, the first at 0."""
    if n <= 0:
        return []
    if spec.rate_per_s == 0:
        return [0.0] * n
    if spec.kind == "fixed":
        return [i / spec.rate_per_s for i in range(n)]
    if spec.kind == "burst":
        return [(i // spec.burst_size) / spec.rate_per_s for i in range(n)]
    out = [0.0]
    for _ in range(n - 1):
        out.append(out[-1] + rng.expovariate(spec.rate_per_s))
    return out
