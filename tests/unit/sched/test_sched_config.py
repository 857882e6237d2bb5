"""SchedulerConfig: DESIGN §5.3/§5.4 defaults, descriptions, and relation checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from marsproxy.sched.config import SchedulerConfig


def test_design_defaults() -> None:
    c = SchedulerConfig()
    assert c.level_thresholds == (2048, 8192, 32768)
    assert c.service_thresholds == (2048.0, 8192.0, 32768.0)
    assert c.service_measure == "tokens"
    assert c.aging_period_s == 30.0
    assert c.priority_override_client is True
    assert c.retention_policy == "mars"
    assert (c.retention_ttl_max_s, c.fixed_retention_s) == (60.0, 2.0)
    assert c.hint_encoder == "headers"


def test_every_field_is_described() -> None:
    for name, field in SchedulerConfig.model_fields.items():
        assert field.description, name


@pytest.mark.parametrize(
    "bad",
    [
        {"level_thresholds": (2048, 2048, 32768)},
        {"level_thresholds": (8192, 2048, 32768)},
        {"level_thresholds": (0, 2048, 32768)},
        {"service_thresholds": (10.0, 5.0, 20.0)},
        {"aging_period_s": 0},
        {"hint_encoder": "grpc"},
        {"service_measure": "flops"},
        {"retention_policy": "always"},
        {"unknown_key": 1},
    ],
)
def test_rejects_bad_values(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        SchedulerConfig.model_validate(bad)


def test_thresholds_from_yaml_lists() -> None:
    c = SchedulerConfig.model_validate({"service_thresholds": [1.0, 10.0, 100.0]})
    assert c.service_thresholds == (1.0, 10.0, 100.0)
