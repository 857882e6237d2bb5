"""Configuration of the probes (mounted into ``MarsConfig`` as ``probes:``).

Same pattern as :mod:`marsproxy.config`: frozen sections, every tunable a ``Field`` with a
default and a description.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from marsproxy.config_section import Section as _Section


class VllmProbeConfig(_Section):
    period_s: float = Field(0.2, gt=0, description="Period of scraping each worker's /metrics.")
    timeout_s: float = Field(
        0.5, gt=0, description="Timeout of one /metrics scrape; a timeout counts as a scrape error."
    )
    stale_after_s: float = Field(
        1.0,
        gt=0,
        description="A worker whose last good sample is older than this is stale: saturated.",
    )

    @model_validator(mode="after")
    def _stale_after_exceeds_period(self) -> VllmProbeConfig:
        # Otherwise every worker would flap to stale between two healthy scrapes.
        if self.stale_after_s <= self.period_s:
            raise ValueError(
                f"stale_after_s ({self.stale_after_s}) must be longer than period_s "
                f"({self.period_s})"
            )
        return self


class NvmlProbeConfig(_Section):
    enabled: bool = Field(
        True, description="Read GPU memory and utilization through NVML when a GPU is present."
    )
    gpus_by_worker: dict[str, tuple[Annotated[int, Field(ge=0)], ...]] = Field(
        default_factory=dict,
        description="GPU indices (NVML numbering) that each worker (by name) runs on.",
    )
    period_s: float = Field(1.0, gt=0, description="Period of reading NVML.")


class CpuProbeConfig(_Section):
    cgroup_path: str = Field(
        "",
        description=(
            "cgroup v2 directory where tools run (e.g. /sys/fs/cgroup/tools.slice); "
            "empty: the host (/proc/pressure/cpu)."
        ),
    )
    tool_cpus: float = Field(
        0.0,
        ge=0,
        description="CPUs available to tools; 0: the cgroup's cpu.max quota, else usable CPUs.",
    )
    period_s: float = Field(1.0, gt=0, description="Period of reading CPU pressure.")


class ProbesConfig(_Section):
    """``probes:`` — vLLM /metrics scraping, NVML and CPU pressure."""

    vllm: VllmProbeConfig = VllmProbeConfig()
    nvml: NvmlProbeConfig = NvmlProbeConfig()
    cpu: CpuProbeConfig = CpuProbeConfig()
