"""What the control plane hears about each worker: the information stream, as observations.

One function per tick turns the scraper's snapshot and the health checker into the plane's
:class:`~marsproxy.policy.observe.WorkerObservation`s (the plane builds its signals from them).
Two cases need care (see docs/admission.md):

- before a worker's first scrape nothing is known: it is stale, so nothing new goes there
  (fail closed); the first scrape starts with the app, so this lasts one scrape period;
- a worker that serves no usable ``/metrics`` at all (a non-vLLM upstream: every scrape fails,
  or the page carries no KV gauge) is not treated as stale forever, which would starve it: it
  is placeable with an unknown KV usage, which the controller reads as full, so its window
  sits at ``window_min`` and sessions keep flowing at that rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from marsproxy.config import WorkerConfig
from marsproxy.policy.observe import WorkerObservation
from marsproxy.probes.vllm_scraper import WorkerPressure


class _Pressures(Protocol):
    def worker_pressure(self, label: str) -> WorkerPressure | None: ...


class _Health(Protocol):
    def is_healthy(self, url: str) -> bool: ...


def observation(pressure: WorkerPressure | None, *, healthy: bool,
                max_num_seqs: int | None = None) -> WorkerObservation:
    """One worker as its latest scrape shows it."""
    base = WorkerObservation(healthy=healthy, stale=True, max_num_seqs=max_num_seqs,
                             max_model_len=None if pressure is None else pressure.max_model_len)
    if pressure is None:  # the scraper is not built yet
        return base
    m = pressure.metrics
    if m is None:
        # Never a good sample. Scraped and failed: no /metrics here (or not reachable yet,
        # which the health checker decides). Not scraped yet: unknown, fail closed until it is.
        return replace(base, stale=pressure.scrape_errors == 0)
    return replace(
        base,
        stale=pressure.stale,
        kv_usage=m.kv_usage,
        running=m.running,
        sampled_at=m.sampled_at,
        preemptions_total=m.preemptions_total,
        prefill_tokens_per_s=pressure.rates.prefill_tokens_per_s,
        total_blocks=m.num_gpu_blocks,
        block_size=m.block_size,
    )


def observations(workers: Sequence[WorkerConfig], pressures: _Pressures,
                 health: _Health) -> dict[str, WorkerObservation]:
    return {w.label: observation(pressures.worker_pressure(w.label),
                                 healthy=health.is_healthy(w.url), max_num_seqs=w.max_num_seqs)
            for w in workers}
