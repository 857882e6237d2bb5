"""Retention decisions against hand-computed cases."""

from __future__ import annotations

import pytest

from marsproxy.core.events import event_to_dict
from marsproxy.sched.config import SchedulerConfig
from marsproxy.sched.retention import decide

CFG = SchedulerConfig()


def test_retain_when_reprefill_exceeds_tool_time() -> None:
    # 20_000 tokens at 5_000 tok/s = 4 s re-prefill > 3 s tool → retain for 3 s.
    out = decide(20_000, 5_000.0, 3.0, CFG, block_size=16)
    assert out.retain is True
    assert out.reprefill_s == pytest.approx(4.0)
    assert out.ttl_s == 3.0
    assert out.blocks == 1250  # 20_000 / 16
    assert "re-prefill" in out.reason


def test_no_retain_when_tool_is_longer_or_equal() -> None:
    out = decide(20_000, 5_000.0, 10.0, CFG, block_size=16)
    assert (out.retain, out.ttl_s, out.blocks) == (False, 0.0, 0)
    assert out.reprefill_s == pytest.approx(4.0)
    # equal: a tie does not pay for the reservation
    assert decide(20_000, 5_000.0, 4.0, CFG).retain is False


def test_ttl_capped_by_max() -> None:
    # 1_000_000 tokens at 10_000 tok/s = 100 s > 90 s tool; TTL capped at 60 s.
    out = decide(1_000_000, 10_000.0, 90.0, CFG)
    assert (out.retain, out.ttl_s) == (True, 60.0)
    assert "capped" in out.reason
    assert out.blocks == 0  # no block size given


def test_no_prediction_means_no_retention() -> None:
    out = decide(20_000, 5_000.0, None, CFG)
    assert out.retain is False
    assert out.reason == "no tool-time prediction"
    assert out.reprefill_s == pytest.approx(4.0)


@pytest.mark.parametrize("tps", [None, 0.0, -1.0])
def test_no_throughput_means_no_retention(tps: float | None) -> None:
    out = decide(20_000, tps, 1.0, CFG)
    assert (out.retain, out.reprefill_s, out.reason) == (
        False, 0.0, "no prefill throughput measured")


def test_empty_context_and_instant_tool() -> None:
    assert decide(0, 5_000.0, 1.0, CFG).reason == "empty context"
    assert decide(20_000, 5_000.0, 0.0, CFG).retain is False


def test_policy_off() -> None:
    out = decide(20_000, 5_000.0, 1.0, SchedulerConfig(retention_policy="off"))
    assert (out.retain, out.reason) == (False, "retention off")


def test_fixed_policy_is_continuum() -> None:
    cfg = SchedulerConfig(retention_policy="fixed")
    # usual tool time 1.5 s ≤ 2 s: retain 2 s, whatever the re-prefill cost.
    out = decide(100, 5_000.0, 1.5, cfg, block_size=16)
    assert (out.retain, out.ttl_s, out.blocks) == (True, 2.0, 7)
    assert decide(100, None, 2.0, cfg).retain is True
    assert decide(1_000_000, 5_000.0, 2.5, cfg).retain is False
    assert decide(100, 5_000.0, None, cfg).retain is False


def test_negative_prediction_is_an_error() -> None:
    with pytest.raises(ValueError):
        decide(100, 5_000.0, -1.0, CFG)



def test_event_carries_inputs() -> None:
    ev = decide(20_000, 5_000.0, 3.0, CFG, block_size=16).to_event(12.5, "s1", "w1")
    d = event_to_dict(ev)
    assert d["type"] == "retention_decision"
    assert (d["ts"], d["session"], d["worker"]) == (12.5, "s1", "w1")
    assert (d["retain"], d["predicted_tool_s"], d["blocks"], d["ttl_s"]) == (True, 3.0, 1250, 3.0)
    assert d["reprefill_s"] == pytest.approx(4.0)
    assert decide(1, 1.0, None, CFG).to_event(0.0, None, None).predicted_tool_s == 0.0
