"""The priority probe's plan (prompt sizes) and how it reads timings."""

from __future__ import annotations

from marsproxy.sched.probe import plan, read


def test_plan_fits_context_and_kv_or_gives_up() -> None:
    assert plan(None, None) is not None and plan(None, None).long_tokens == 16_384  # type: ignore[union-attr]
    assert plan(4096, None).long_tokens == 4080  # type: ignore[union-attr]
    p = plan(4096, 5120)
    assert p is not None and p.long_tokens == (5120 - 32) * 2 // 3 and p.blocker_tokens == 1696
    assert plan(200, None) is None  # too small to need several prefill chunks


def test_read_needs_a_clear_lead_of_the_short_request() -> None:
    # blocker done at 0.2 s, short at 0.4 s, long at 1.2 s: lead 0.8 of 1.0 s → priority
    yes = read(0.2, 1.2, 0.4, 0.25)
    assert yes.honours_priority and "80%" in yes.reason
    # FCFS: the short one finishes with (or after) the long one
    assert not read(0.2, 1.0, 0.98, 0.25).honours_priority
    assert not read(0.2, 1.0, 1.2, 0.25).honours_priority
    assert not read(5.0, 5.0, 4.0, 0.25).honours_priority  # no span: unreadable


def test_the_lead_is_measured_from_the_blockers_end_not_from_sending() -> None:
    # The requests took 1.5 s to reach the engine (a busy API server): the engine's choice
    # (short 0.1 s after the blocker, long 0.2 s after) is what counts, not the wait before.
    slow_delivery = read(1.53, 1.63, 1.54, 0.25)
    assert slow_delivery.honours_priority, slow_delivery.reason
