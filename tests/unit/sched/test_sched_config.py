"""SchedulerConfig: defaults, descriptions, the tuning section, and relation checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from marsproxy.sched.config import SchedulerConfig, SchedulerTuning


def test_defaults() -> None:
    c = SchedulerConfig()
    t = c.tuning
    assert c.priority_policy == "session_fcfs"
    assert t.service_thresholds == (2048.0, 8192.0, 32768.0)
    assert t.service_measure == "tokens"
    assert t.aging_period_s == 30.0
    assert c.priority_override_client is True
    assert c.retention_policy == "mars"
    assert (t.retention_ttl_max_s, t.fixed_retention_s) == (60.0, 2.0)
    assert c.hint_encoder == "headers"


def test_every_field_is_described() -> None:
    for model in (SchedulerConfig, SchedulerTuning):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name}"


@pytest.mark.parametrize(
    "bad",
    [
        {"tuning": {"service_thresholds": (10.0, 10.0, 20.0)}},
        {"tuning": {"service_thresholds": (10.0, 5.0, 20.0)}},
        {"tuning": {"service_thresholds": (0.0, 5.0, 20.0)}},
        {"priority_policy": "mars"},  # lost to session_fcfs; config_moves names it
        {"tuning": {"aging_period_s": 0}},
        {"hint_encoder": "grpc"},
        {"tuning": {"service_measure": "flops"}},
        {"retention_policy": "always"},
        {"unknown_key": 1},
        {"kv_reserve_frac": 0.1},  # one reserve for both planes: admission.kv_reserve_frac
    ],
)
def test_rejects_bad_values(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        SchedulerConfig.model_validate(bad)


def test_thresholds_from_yaml_lists() -> None:
    c = SchedulerConfig.model_validate({"tuning": {"service_thresholds": [1.0, 10.0, 100.0]}})
    assert c.tuning.service_thresholds == (1.0, 10.0, 100.0)
