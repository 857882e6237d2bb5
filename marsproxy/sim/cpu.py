"""Processor sharing of the tool CPUs: K cores; with n > K tools running each gets K/n of a core.

A tool is CPU work of ``work_s`` core-seconds (its time alone). Egalitarian processor sharing is
run with a virtual-work clock: ``V`` grows at the rate every running tool gets (min(1, K/n)), and
a tool finishes when ``V`` reaches its start value plus its work, so one heap ordered by finish
values answers "which tool ends next" in O(log n).

Pure code: no I/O; ``now`` is a parameter.
"""

from __future__ import annotations

import heapq

_EPS = 1e-9


class ProcessorSharing:
    def __init__(self, cpus: float) -> None:
        if cpus <= 0:
            raise ValueError("cpus must be > 0")
        self.cpus = cpus
        self._v = 0.0
        self._last = 0.0
        self._heap: list[tuple[float, int, str]] = []
        self._seq = 0

    @property
    def running(self) -> int:
        return len(self._heap)

    def _rate(self) -> float:
        n = len(self._heap)
        return 1.0 if n <= self.cpus else self.cpus / n

    def _advance(self, now: float) -> None:
        if now < self._last - _EPS:
            raise ValueError(f"time went backwards: {now} < {self._last}")
        if self._heap:
            self._v += (now - self._last) * self._rate()
        self._last = max(self._last, now)

    def add(self, now: float, job: str, work_s: float) -> None:
        self._advance(now)
        self._seq += 1
        heapq.heappush(self._heap, (self._v + max(0.0, work_s), self._seq, job))

    def next_completion(self) -> float | None:
        """When the next tool ends if nothing else starts meanwhile."""
        if not self._heap:
            return None
        return self._last + max(0.0, self._heap[0][0] - self._v) / self._rate()

    def pop_done(self, now: float) -> list[str]:
        """Tools finished by ``now`` (in finishing order)."""
        self._advance(now)
        out = []
        while self._heap and self._heap[0][0] <= self._v + _EPS:
            out.append(heapq.heappop(self._heap)[2])
        return out
