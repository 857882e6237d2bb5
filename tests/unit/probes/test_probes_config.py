"""ProbesConfig: defaults, validation, and the shape the lead mounts as ``probes:``."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from marsproxy.probes.config import CpuProbeConfig, NvmlProbeConfig, ProbesConfig, VllmProbeConfig


def test_defaults() -> None:
    cfg = ProbesConfig()
    v = cfg.vllm
    assert (v.period_s, v.idle_period_s, v.timeout_s, v.stale_after_s) == (0.2, 1.0, 0.5, 2.5)
    assert cfg.nvml.enabled and cfg.nvml.gpus_by_worker == {} and cfg.nvml.period_s == 1.0
    assert (cfg.cpu.cgroup_path, cfg.cpu.tool_cpus, cfg.cpu.period_s) == ("", 0.0, 1.0)


def test_every_field_is_described() -> None:
    for section in (VllmProbeConfig, NvmlProbeConfig, CpuProbeConfig):
        for name, info in section.model_fields.items():
            assert info.description, f"{section.__name__}.{name} has no description"


def test_from_yaml_like_mapping() -> None:
    cfg = ProbesConfig.model_validate(
        {
            "vllm": {"period_s": 0.1, "idle_period_s": 0.3, "stale_after_s": 0.5},
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
        {"vllm": {"stale_after_s": 1.0}},  # not longer than the idle period (1 s)
        {"vllm": {"period_s": 3.0, "idle_period_s": 0.5, "stale_after_s": 3.0}},
        {"vllm": {"unknown": 1}},
        {"nvml": {"gpus_by_worker": {"w0": [-1]}}},
        {"cpu": {"tool_cpus": -1}},
    ],
)
def test_invalid(data: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ProbesConfig.model_validate(data)


def test_stale_error_names_the_periods() -> None:
    with pytest.raises(ValidationError, match=r"idle_period_s 1\.0\): raise it, or lower"):
        VllmProbeConfig(stale_after_s=1.0)


def test_a_slow_period_makes_the_idle_one_moot() -> None:
    # An operator who slows every scrape need not touch idle_period_s.
    cfg = VllmProbeConfig(period_s=5.0, stale_after_s=12.0)
    assert cfg.slowest_period_s == 5.0


def test_frozen() -> None:
    cfg = ProbesConfig()
    with pytest.raises(ValidationError):
        cfg.vllm.period_s = 1.0  # type: ignore[misc]
