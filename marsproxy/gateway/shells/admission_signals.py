"""What the admission core hears about each worker: the information stream, as ``WorkerSignals``.

One function per control tick turns the scraper's snapshot, the health checker and the CPU /
tool-phase probes into the core's input. Two cases need care (see docs/admission.md):

- before a worker's first scrape nothing is known: it is stale, so nothing new goes there
  (fail closed); the first scrape starts with the app, so this lasts one scrape period;
- a worker that serves no usable ``/metrics`` at all (a non-vLLM upstream: every scrape fails,
  or the page carries no KV gauge) is not treated as stale forever, which would starve it: it
  is placeable with an unknown KV usage, which the controller reads as full, so its window
  sits at ``window_min`` and sessions keep flowing at that rate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from marsproxy.aimd.admission import WorkerSignals
from marsproxy.core.kv import free_blocks_from_usage
from marsproxy.probes.tool_signal import ToolCpuSignals
from marsproxy.probes.vllm_scraper import WorkerPressure


def worker_signals(
    pressure: WorkerPressure | None,
    *,
    healthy: bool,
    tools: ToolCpuSignals,
    tool_cpus: float,
    retained_blocks: int = 0,
    sessions_elsewhere: int = 0,
) -> WorkerSignals:
    """One worker's ``WorkerSignals`` from its latest scrape and the shared tool-CPU signals;
    ``retained_blocks``: the scheduler's KV ledger on this worker (off the admission budget);
    ``sessions_elsewhere``: sessions other replicas hold there (the forecast-peak fit)."""
    base = WorkerSignals(
        healthy=healthy,
        retained_blocks=retained_blocks,
        sessions_elsewhere=max(0, sessions_elsewhere),
        tools_in_flight=tools.tools_in_flight,
        backlog_ratio=tools.backlog_ratio,
        tool_wait_ema_s=tools.tool_wait_ema_s,
        psi_some_avg10=tools.psi_some_avg10,
        tool_cpus=tool_cpus,
    )
    if pressure is None:  # the scraper is not built yet
        return replace(base, stale=True)
    m = pressure.metrics
    if m is None:
        # Never a good sample. Scraped and failed: no /metrics here (or not reachable yet,
        # which the health checker decides). Not scraped yet: unknown, fail closed until it is.
        return replace(base, stale=pressure.scrape_errors == 0)
    total = m.num_gpu_blocks
    return replace(
        base,
        stale=pressure.stale,
        kv_usage=m.kv_usage,
        running=m.running,
        sampled_at=m.sampled_at,
        preemptions_total=m.preemptions_total,
        prefill_tokens_per_s=pressure.rates.prefill_tokens_per_s,
        free_blocks=free_blocks_from_usage(m.kv_usage, total),
        total_blocks=total,
        block_size=m.block_size,
    )


def all_signals(
    pressures: Mapping[str, WorkerPressure | None],
    healthy: Mapping[str, bool],
    tools: ToolCpuSignals,
    tool_cpus: float,
    retained: Mapping[str, int] | None = None,
    elsewhere: Mapping[str, int] | None = None,
) -> dict[str, WorkerSignals]:
    retained = retained or {}
    elsewhere = elsewhere or {}
    return {
        w: worker_signals(p, healthy=healthy[w], tools=tools, tool_cpus=tool_cpus,
                          retained_blocks=retained.get(w, 0),
                          sessions_elsewhere=elsewhere.get(w, 0))
        for w, p in pressures.items()
    }
