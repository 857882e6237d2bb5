"""The prefill speed a worker's metrics scraper would report, from the calls that finished.

As ``marsproxy.probes.vllm_rates.MetricsTracker`` (its best source): the prefill-computed
tokens of the requests that finished since the last sample over their prefill time; an interval
in which nothing finished keeps the previous value. Pure code; the simulator samples it on each
scheduler tick, as the gateway reads the scraper.
"""

from __future__ import annotations


class PrefillRate:
    def __init__(self) -> None:
        self._tokens = 0
        self._seconds = 0.0
        self._rate: float | None = None

    def observe(self, computed_tokens: int, prefill_s: float) -> None:
        """A request finished: ``computed_tokens`` prefilled (cache hits excluded) in
        ``prefill_s`` seconds."""
        self._tokens += max(0, computed_tokens)
        self._seconds += max(0.0, prefill_s)

    def sample(self) -> float | None:
        """Tokens per second over the interval since the last sample (or the last known)."""
        if self._seconds > 0:
            self._rate = self._tokens / self._seconds
        self._tokens, self._seconds = 0, 0.0
        return self._rate
