"""ProbesConfig: defaults, validation, and the shape the lead mounts as ``probes:``."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from marsproxy.probes.config import CpuProbeConfig, NvmlProbeConfig, ProbesConfig, VllmProbeConfig


def test_defaults() -> None:
    cfg = ProbesConfig()
    assert (cfg.vllm.period_s, cfg.vllm.timeout_s, cfg.vllm.stale_after_s) == (0.2, 0.5, 1.0)
    assert cfg.nvml.enabled and cfg.nvml.gpus_by_worker == {} and cfg.nvml.period_s == 1.0
    assert (cfg.cpu.cgroup_path, cfg.cpu.tool_cpus, cfg.cpu.period_s) == ("", 0.0, 1.0)


def test_every_field_is_described() -> None:
    for section in (VllmProbeConfig, NvmlProbeConfig, CpuProbeConfig):
        for name, info in section.model_fields.items():
            assert info.description, f"{section.__name__}.{name} has no description"


def test_from_yaml_like_mapping() -> None:
    cfg = ProbesConfig.model_validate(
        {
            "vllm": {"period_s": 0.1, "stale_after_s": 0.5},
            "nvml": {"gpus_by_worker": {"w0": [0, 1], "w1": [2]}},
            "cpu": {"cgroup_path": "/sys/fs/cgroup/tools.slice", "tool_cpus": 8},
        }
    )
    assert cfg.nvml.gpus_by_worker == {"w0": (0, 1), "w1": (2,)}
    assert cfg.cpu.tool_cpus == 8.0


@pytest.mark.parametrize(
    "data",
    [
        {"vllm": {"period_s": 0}},
        {"vllm": {"stale_after_s": 0.2}},  # not longer than the period: would always flap
        {"vllm": {"unknown": 1}},
        {"nvml": {"gpus_by_worker": {"w0": [-1]}}},
        {"cpu": {"tool_cpus": -1}},
    ],
)
def test_invalid(data: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ProbesConfig.model_validate(data)


def test_frozen() -> None:
    cfg = ProbesConfig()
    with pytest.raises(ValidationError):
        cfg.vllm.period_s = 1.0  # type: ignore[misc]
