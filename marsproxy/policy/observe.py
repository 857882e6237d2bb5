"""What a driver observes about a worker, and the planes' inputs built from it once.

The gateway observes a worker through its scraper and health checker, the simulator through its
engine; both hand the plane a :class:`WorkerObservation`, and the admission signals and the
scheduler's facts are built from it here, for both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from marsproxy.aimd.admission import WorkerSignals
from marsproxy.core.kv import free_blocks_from_usage
from marsproxy.probes.tool_signal import ToolCpuSignals
from marsproxy.sched.tickets import WorkerFacts


@dataclass(frozen=True, slots=True)
class WorkerObservation:
    """One worker as last observed; ``None``: not reported."""

    healthy: bool = True
    stale: bool = True
    """Nothing current is known (not scraped yet, or the last sample is too old): fail closed."""
    kv_usage: float | None = None
    total_blocks: int | None = None
    block_size: int | None = None
    running: int | None = None
    preemptions_total: float | None = None
    prefill_tokens_per_s: float | None = None
    sampled_at: float | None = None
    """When the gauges were read, on the plane's clock."""
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    """The longest context the worker serves (vLLM's ``/v1/models``)."""
    session_blocks: Mapping[str, int] | None = None
    """Resident blocks per session from the worker's KV index (``None``: no usable index)."""


def admission_signals(
    obs: WorkerObservation, tools: ToolCpuSignals, tool_cpus: float, *,
    retained_blocks: int = 0, sessions_elsewhere: int = 0,
) -> WorkerSignals:
    """The admission core's view of one worker; ``retained_blocks``: the scheduler's ledger
    there; ``sessions_elsewhere``: sessions other replicas hold there."""
    return WorkerSignals(
        healthy=obs.healthy, stale=obs.stale, kv_usage=obs.kv_usage,
        free_blocks=free_blocks_from_usage(obs.kv_usage, obs.total_blocks),
        total_blocks=obs.total_blocks, block_size=obs.block_size,
        retained_blocks=retained_blocks, sessions_elsewhere=max(0, sessions_elsewhere),
        running=obs.running, preemptions_total=obs.preemptions_total,
        prefill_tokens_per_s=obs.prefill_tokens_per_s, sampled_at=obs.sampled_at,
        tools_in_flight=tools.tools_in_flight, backlog_ratio=tools.backlog_ratio,
        tool_wait_ema_s=tools.tool_wait_ema_s, psi_some_avg10=tools.psi_some_avg10,
        tool_cpus=tool_cpus, max_model_len=obs.max_model_len,
        session_blocks=obs.session_blocks,
    )


def scheduler_facts(obs: WorkerObservation) -> WorkerFacts:
    """The scheduler core's facts about one worker (no KV gauge while the sample is stale)."""
    return WorkerFacts(
        max_num_seqs=obs.max_num_seqs, total_blocks=obs.total_blocks,
        block_size=obs.block_size, prefill_tokens_per_s=obs.prefill_tokens_per_s,
        kv_usage=None if obs.stale else obs.kv_usage,
    )
