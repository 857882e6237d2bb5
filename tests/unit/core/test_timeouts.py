"""How long a dormant session keeps its KV room and slot, and its admission."""

from __future__ import annotations

import pytest

from marsproxy.core.timeouts import idle_timeout_s, kv_hold_s


@pytest.mark.parametrize(
    ("usual", "timeout"), [(None, 60.0), (1.0, 60.0), (30.0, 120.0), (1000.0, 1800.0)]
)
def test_idle_timeout_clamped(usual: float | None, timeout: float) -> None:
    assert idle_timeout_s(usual, 4.0, 60.0, 1800.0) == timeout


def test_the_hold_scales_with_the_usual_tool_time_within_its_bounds() -> None:
    assert kv_hold_s(None, 4.0, 5.0, 60.0) == 5.0  # no tool history: the floor
    assert kv_hold_s(None, 4.0, 90.0, 60.0) == 60.0
    assert kv_hold_s(0.1, 4.0, 5.0, 60.0) == 5.0
    assert kv_hold_s(3.0, 4.0, 5.0, 60.0) == 12.0
    assert kv_hold_s(30.0, 4.0, 5.0, 60.0) == 60.0


def test_a_prefix_cheap_to_rebuild_lowers_the_floor_once_tool_history_exists() -> None:
    # floor min(20, 4 × 0.5 s) = 2 s; the usual tool time still sets a longer hold
    assert kv_hold_s(0.1, 4.0, 20.0, 60.0, reprefill_s=0.5, reprefill_factor=4.0) == 2.0
    assert kv_hold_s(1.0, 4.0, 20.0, 60.0, reprefill_s=0.5, reprefill_factor=4.0) == 4.0
    assert kv_hold_s(0.1, 4.0, 20.0, 60.0, reprefill_s=30.0, reprefill_factor=4.0) == 20.0
    # no tool history: the floor stands (the first gap's hold tells whether sessions return)
    assert kv_hold_s(None, 4.0, 20.0, 60.0, reprefill_s=0.5, reprefill_factor=4.0) == 20.0
    # off, or the prefill speed unknown
    assert kv_hold_s(0.1, 4.0, 20.0, 60.0, reprefill_s=0.5, reprefill_factor=0.0) == 20.0
    assert kv_hold_s(0.1, 4.0, 20.0, 60.0, reprefill_s=None, reprefill_factor=4.0) == 20.0
