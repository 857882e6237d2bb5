"""NvmlProbe with a fake NVML library, and the real pynvml on this GPU-less machine."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from marsproxy.probes.config import NvmlProbeConfig
from marsproxy.probes.nvml import GpuPressure, NvmlProbe

GiB = 1024**3


class FakeNVMLError(Exception):
    pass


@dataclass
class FakeNvml:
    """The library boundary: the calls NvmlProbe makes, with scripted answers."""

    gpus: list[tuple[int, int, int, int]] = field(default_factory=list)  # used, total, gpu%, mem%
    fail_init: bool = False
    fail_index: int | None = None
    calls: list[str] = field(default_factory=list)
    NVMLError: type[Exception] = FakeNVMLError

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.fail_init:
            raise FakeNVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if index == self.fail_index:
            raise FakeNVMLError("GPU is lost")
        return ("handle", index)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        used, total, _, _ = self.gpus[handle[1]]
        return SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        _, _, gpu, mem = self.gpus[handle[1]]
        return SimpleNamespace(gpu=gpu, memory=mem)


def four_gpus() -> FakeNvml:
    return FakeNvml(
        gpus=[
            (10 * GiB, 80 * GiB, 90, 40),
            (60 * GiB, 80 * GiB, 70, 30),
            (20 * GiB, 141 * GiB, 10, 5),
            (0, 141 * GiB, 0, 0),
        ]
    )


def test_values_mapped_per_worker() -> None:
    nvml = four_gpus()
    probe = NvmlProbe({"w0": [0, 1], "w1": [2]}, nvml=nvml)
    assert probe.start() and probe.available
    w0 = probe.read("w0")
    assert w0.available and [g.index for g in w0.gpus] == [0, 1]
    assert w0.gpus[1].memory_used_bytes == 60 * GiB
    assert w0.memory_used_frac == pytest.approx(0.75)  # the fuller GPU of the two
    assert w0.utilization_pct == pytest.approx(80.0)
    w1 = probe.read("w1")
    assert [g.index for g in w1.gpus] == [2]
    assert w1.gpus[0].memory_total_bytes == 141 * GiB
    assert w1.gpus[0].memory_utilization_pct == 5.0
    assert set(probe.read_all()) == {"w0", "w1"}
    probe.stop()
    assert nvml.calls == ["init", "shutdown"]
    assert not probe.read("w0").available


def test_unmapped_worker_and_missing_gpu_are_unavailable() -> None:
    probe = NvmlProbe({"w0": [0], "w9": [7]}, nvml=four_gpus())
    assert probe.start()
    assert probe.read("other") == GpuPressure(
        "other", available=False, reason="no GPUs mapped to this worker"
    )
    r = probe.read("w9")
    assert not r.available and r.reason == "GPU 7 not present"


def test_init_error_means_unavailable_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml(fail_init=True)
    probe = NvmlProbe({"w0": [0]}, nvml=nvml)
    with caplog.at_level(logging.DEBUG, logger="marsproxy.probes.nvml"):
        assert probe.start() is False
        r = probe.read("w0")
        probe.read_all()
        probe.stop()
    assert not probe.available
    assert not r.available and r.reason is not None and "Driver Not Loaded" in r.reason
    assert r.memory_used_frac is None and r.utilization_pct is None
    assert len(caplog.records) == 1
    assert "NVML probe off" in caplog.records[0].getMessage()
    assert "shutdown" not in nvml.calls  # never initialised: nothing to shut down


def test_no_gpu_is_unavailable(caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml(gpus=[])
    with caplog.at_level(logging.INFO, logger="marsproxy.probes.nvml"):
        assert NvmlProbe({}, nvml=nvml).start() is False
    assert [r.getMessage() for r in caplog.records] == ["NVML probe off: NVML sees no GPU"]
    assert nvml.calls == ["init", "shutdown"]


def test_read_error_affects_that_read_only() -> None:
    nvml = four_gpus()
    probe = NvmlProbe({"w0": [0, 1], "w1": [2]}, nvml=nvml)
    probe.start()
    nvml.fail_index = 1
    r = probe.read("w0")
    assert not r.available and r.reason == "GPU 1: GPU is lost"
    assert probe.read_errors == 1
    assert probe.read("w1").available and probe.available


def test_disabled_by_config_never_touches_the_library() -> None:
    nvml = four_gpus()
    probe = NvmlProbe.from_config(
        NvmlProbeConfig(enabled=False, gpus_by_worker={"w0": (0,)}), nvml=nvml
    )
    assert probe.start() is False
    assert nvml.calls == []
    assert not probe.read("w0").available


def test_real_pynvml_without_gpu_degrades(caplog: pytest.LogCaptureFixture) -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML; the degraded path is not reachable")
    probe = NvmlProbe({"w0": [0]})
    with caplog.at_level(logging.INFO, logger="marsproxy.probes.nvml"):
        assert probe.start() is False
        r = probe.read("w0")
        probe.stop()
    assert not probe.available and not r.available
    assert len(caplog.records) == 1 and "NVML init failed" in caplog.records[0].getMessage()
