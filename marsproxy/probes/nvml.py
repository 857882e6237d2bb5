"""GPU memory and utilization per worker through NVML (``nvidia-ml-py``, ``import pynvml``).

Optional by nature: without the library, the driver, or a GPU the probe logs one line at
start, reports ``available = False``, and every read returns an unavailable result. Nothing
here raises into callers. The NVML module is a constructor parameter so tests can fake it at
the library boundary.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from marsproxy.probes.config import NvmlProbeConfig

log = logging.getLogger(__name__)


class NvmlLibrary(Protocol):
    """The part of the ``pynvml`` module this probe uses."""

    NVMLError: type[Exception]

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class GpuReading:
    index: int
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_pct: float
    """GPU (SM) busy percentage over NVML's last sample period, 0..100."""
    memory_utilization_pct: float
    """Memory-controller busy percentage, 0..100."""

    @property
    def memory_used_frac(self) -> float:
        return self.memory_used_bytes / self.memory_total_bytes if self.memory_total_bytes else 0.0


@dataclass(frozen=True, slots=True)
class GpuPressure:
    """The GPUs of one worker; ``available`` is False when any of them could not be read."""

    worker: str
    available: bool
    gpus: tuple[GpuReading, ...] = ()
    reason: str | None = None
    """Why not available."""

    @property
    def memory_used_frac(self) -> float | None:
        """Highest memory use among the worker's GPUs (the fullest one limits it), 0..1."""
        return max((g.memory_used_frac for g in self.gpus), default=None)

    @property
    def utilization_pct(self) -> float | None:
        """Mean GPU utilization over the worker's GPUs (tensor-parallel ranks work together)."""
        if not self.gpus:
            return None
        return sum(g.utilization_pct for g in self.gpus) / len(self.gpus)


class NvmlProbe:
    """Reads the GPUs mapped to each worker. Call :meth:`start` once, :meth:`stop` at the end."""

    def __init__(
        self,
        gpus_by_worker: Mapping[str, Sequence[int]],
        *,
        enabled: bool = True,
        nvml: NvmlLibrary | None = None,
    ) -> None:
        self._gpus_by_worker = {w: tuple(ix) for w, ix in gpus_by_worker.items()}
        self._enabled = enabled
        self._nvml = nvml
        self._device_count = 0
        self.available = False
        self.reason: str | None = "not started"
        self.read_errors = 0

    @classmethod
    def from_config(cls, cfg: NvmlProbeConfig, *, nvml: NvmlLibrary | None = None) -> NvmlProbe:
        return cls(cfg.gpus_by_worker, enabled=cfg.enabled, nvml=nvml)

    def start(self) -> bool:
        """Initialise NVML; True when GPUs can be read. Logs exactly one line either way."""
        if not self._enabled:
            return self._off("disabled by config (probes.nvml.enabled)")
        if self._nvml is None:
            try:
                import pynvml  # optional at run time: absent on CPU-only hosts
            except ImportError as exc:
                return self._off(f"nvidia-ml-py not installed ({exc})")
            self._nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            return self._off(f"NVML init failed ({exc}): no driver or no GPU")
        try:
            self._device_count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            self._shutdown_quietly()
            return self._off(f"NVML device count failed ({exc})")
        if self._device_count == 0:
            self._shutdown_quietly()
            return self._off("NVML sees no GPU")
        self.available, self.reason = True, None
        unknown = {
            w: [i for i in ix if i >= self._device_count]
            for w, ix in self._gpus_by_worker.items()
            if any(i >= self._device_count for i in ix)
        }
        extra = (
            f"; GPU indices beyond the {self._device_count} present: {unknown}" if unknown else ""
        )
        log.info(
            "NVML probe on: %d GPU(s), mapping %s%s",
            self._device_count,
            self._gpus_by_worker,
            extra,
        )
        return True

    def stop(self) -> None:
        if self.available:
            self._shutdown_quietly()
        self.available, self.reason = False, "stopped"

    def read(self, worker: str) -> GpuPressure:
        """Memory and utilization of ``worker``'s GPUs; unavailable rather than raising."""
        if not self.available or self._nvml is None:
            return GpuPressure(worker, available=False, reason=self.reason)
        indices = self._gpus_by_worker.get(worker)
        if not indices:
            return GpuPressure(worker, available=False, reason="no GPUs mapped to this worker")
        nvml = self._nvml
        readings: list[GpuReading] = []
        for index in indices:
            if index >= self._device_count:
                return GpuPressure(worker, available=False, reason=f"GPU {index} not present")
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                util = nvml.nvmlDeviceGetUtilizationRates(handle)
            except nvml.NVMLError as exc:
                # A GPU that fell off the bus or a driver hiccup: this read only.
                self.read_errors += 1
                return GpuPressure(worker, available=False, reason=f"GPU {index}: {exc}")
            readings.append(
                GpuReading(
                    index=index,
                    memory_used_bytes=int(mem.used),
                    memory_total_bytes=int(mem.total),
                    utilization_pct=float(util.gpu),
                    memory_utilization_pct=float(util.memory),
                )
            )
        return GpuPressure(worker, available=True, gpus=tuple(readings))

    def read_all(self) -> dict[str, GpuPressure]:
        return {w: self.read(w) for w in self._gpus_by_worker}

    def _off(self, reason: str) -> bool:
        self.available, self.reason = False, reason
        log.info("NVML probe off: %s", reason)
        return False

    def _shutdown_quietly(self) -> None:
        if self._nvml is None:
            return
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)
