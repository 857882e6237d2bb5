"""AdmissionConfig: defaults, descriptions, the tuning section, and relation checks."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from marsproxy.aimd.config import AdmissionConfig, AdmissionTuning


def test_defaults() -> None:
    c = AdmissionConfig()
    t = c.tuning
    assert c.enabled is True
    assert (c.window_init, c.window_min, c.window_max, t.increase) == (30, 4, None, 1)
    assert (t.decrease, t.control_interval_s) == (0.85, 0.2)
    assert (t.kv_enter, t.kv_leave) == (0.90, 0.85)
    assert (t.cpu_backlog_enter, t.cpu_backlog_leave) == (2.0, 1.0)
    assert (t.tool_wait_enter_s, t.tool_wait_leave_s) == (5.0, 2.0)
    assert (t.use_psi, t.psi_enter, t.psi_leave) == (False, 60.0, 30.0)
    assert (c.kv_reserve_frac, t.app_limited_frac) == (0.10, 0.5)
    assert (t.long_prompt_tokens, t.max_long_in_flight, t.long_pack_frac) == (50_000, 2, 0.9)
    assert (c.queue_deadline_s, c.queue_max) == (300.0, 10_000)
    assert (c.idle_timeout_factor, c.idle_timeout_min_s, c.idle_timeout_max_s) == (
        4.0, 60.0, 1800.0)
    assert t.chars_per_token == 4.0
    assert (t.retry_after_min_s, t.retry_after_max_s) == (1, 60)


def test_every_field_is_described() -> None:
    for model in (AdmissionConfig, AdmissionTuning):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"window_min": 10, "window_init": 5}, "window_min"),
        ({"window_init": 40, "window_max": 30}, "window_init ≤ window_max"),
        ({"tuning": {"kv_leave": 0.9}}, "kv_leave < kv_enter"),
        ({"tuning": {"kv_leave": 0.95}}, "kv_leave < kv_enter"),
        ({"tuning": {"cpu_backlog_leave": 2.0}}, "cpu_backlog_leave"),
        ({"tuning": {"tool_wait_leave_s": 6.0}}, "tool_wait_leave_s"),
        ({"tuning": {"psi_leave": 70.0}}, "psi_leave"),
        ({"idle_timeout_min_s": 4000.0}, "idle_timeout_min_s"),
        ({"tuning": {"retry_after_min_s": 90}}, "retry_after_min_s"),
        ({"tuning": {"aging_margin_s": 300.0}}, "aging_margin_s < queue_deadline_s"),
        ({"tuning": {"decrease": 1.0}}, "decrease"),
        ({"window_min": 0}, "window_min"),
        ({"bogus": 1}, "bogus"),
        ({"peak_growth_prior": 3.0}, "peak_growth_prior"),  # tuning keys only under tuning
    ],
)
def test_bad_relations_are_rejected(data: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError) as exc:
        AdmissionConfig.model_validate(data)
    assert needle in str(exc.value)


def test_frozen() -> None:
    c = AdmissionConfig()
    with pytest.raises(ValidationError):
        c.window_max = 50  # type: ignore[misc]
