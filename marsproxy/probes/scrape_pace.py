"""How often to scrape a worker's ``/metrics``: every ``period_s`` while it serves or sessions
wait for it, every ``idle_period_s`` while it is idle.

vLLM renders its metrics page in its API server process for every scrape (about 1.7 ms of CPU
for the series the proxy reads, 4 ms for the whole page). An idle engine's page does not change
until a request reaches it, and the proxy sees those requests go by: five scrapes a second
would be CPU the idle server need not spend. Only idle counts: on a serving worker a
reading a second old lets admission misjudge calls that grew or ended since (measured: slower
sessions on the emulated KV-bound workload with a slow pace whenever the KV had room).
Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from marsproxy.probes.vllm_metrics import WorkerMetrics


@dataclass(frozen=True, slots=True)
class ScrapePace:
    period_s: float
    idle_period_s: float

    def period(self, latest: WorkerMetrics | None, *, failing: bool, busy: bool) -> float:
        """Seconds to the next scrape of a worker whose last good sample is ``latest``;
        ``failing``: its last scrape failed; ``busy``: the proxy has calls in flight on it or
        sessions waiting for it (admission queue, dispatch gate)."""
        if busy or failing or latest is None:
            return self.period_s
        if latest.running != 0 or latest.waiting not in (0, None):
            return self.period_s  # someone else's calls (another replica, a direct client)
        return self.idle_period_s
