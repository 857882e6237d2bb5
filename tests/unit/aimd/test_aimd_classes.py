"""AdmissionQueue with service classes and tenants: order, yielding, deadlines, refusals."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from marsproxy.aimd.config import AdmissionConfig, AdmissionTuning, ServiceClasses
from marsproxy.aimd.queue import AdmissionQueue, OrderMode, WorkerView

CFG = AdmissionConfig(tuning=AdmissionTuning(long_prompt_tokens=1000))


def worker(**kw: Any) -> WorkerView:
    base: dict[str, Any] = dict(admitted=0, limit=10, budget_blocks=10_000, free_blocks=20_000)
    base.update(kw)
    return WorkerView(name="w0", **base)


def picked(q: AdmissionQueue, now: float, **kw: Any) -> list[str]:
    return [a.entry.session for a in q.select(now, [worker(**kw)])]


def test_interactive_goes_ahead_of_earlier_batch() -> None:
    q = AdmissionQueue(CFG)
    for i in range(3):
        assert q.push(q.entry(f"b{i}", "t", float(i), 100, "batch"))
    assert q.push(q.entry("i0", "t", 5.0, 100, "interactive"))
    assert picked(q, 6.0, limit=2) == ["i0", "b0"]


def test_unknown_or_missing_class_is_the_default() -> None:
    q = AdmissionQueue(CFG)
    assert q.entry("a", "t", 0.0, 1).cls == "interactive"
    assert q.entry("b", "t", 0.0, 1, "gold").cls == "interactive"


def test_an_interactive_session_that_does_not_fit_holds_batch_back() -> None:
    q = AdmissionQueue(CFG)
    assert q.push(q.entry("i0", "t", 0.0, 900, "interactive"))  # 57 blocks
    assert q.push(q.entry("b0", "t", 1.0, 100, "batch"))  # 7 blocks
    # Room for the batch session but not the interactive one: batch yields.
    assert picked(q, 2.0, admitted=1, budget_blocks=20) == []
    assert picked(q, 3.0, admitted=1, budget_blocks=100) == ["i0", "b0"]


def test_batch_fills_what_interactive_leaves() -> None:
    q = AdmissionQueue(CFG)
    assert q.push(q.entry("i0", "t", 0.0, 100, "interactive"))
    for i in range(3):
        assert q.push(q.entry(f"b{i}", "t", 1.0 + i, 100, "batch"))
    assert picked(q, 5.0, limit=3) == ["i0", "b0", "b1"]


def test_class_deadlines() -> None:
    cfg = AdmissionConfig(queue_deadline_s=60.0, classes=ServiceClasses(
        queue_deadline_s={"batch": 600.0}))
    q = AdmissionQueue(cfg)
    assert q.entry("i", "t", 0.0, 1, "interactive").deadline == 60.0
    assert q.entry("b", "t", 0.0, 1, "batch").deadline == 600.0
    q.push(q.entry("i", "t", 0.0, 1, "interactive"))
    q.push(q.entry("b", "t", 0.0, 1, "batch"))
    assert [e.session for e in q.expire(61.0)] == ["i"]
    assert "b" in q


def test_tenants_take_turns_by_served_tokens() -> None:
    q = AdmissionQueue(CFG)
    for i in range(4):
        assert q.push(q.entry(f"h{i}", "heavy", float(i), 100))
    assert q.push(q.entry("l0", "light", 10.0, 100))
    assert q.push(q.entry("l1", "light", 11.0, 100))
    # Arrival order would admit h0..h3 first; fair shares alternate (name order breaks ties).
    assert [e.session for e in q.ordered(12.0, OrderMode.ARRIVAL)][:4] == ["h0", "l0", "h1", "l1"]
    assert picked(q, 12.0, limit=3) == ["h0", "l0", "h1"]


def test_a_tenant_that_was_served_more_waits() -> None:
    q = AdmissionQueue(CFG)
    q.push(q.entry("h0", "heavy", 0.0, 100))
    q.push(q.entry("l0", "light", 0.5, 100))
    assert picked(q, 1.0, limit=2) == ["h0", "l0"]
    q.charge("heavy", "h0", 5000)  # its session ran long turns
    q.push(q.entry("h1", "heavy", 2.0, 100))
    q.push(q.entry("l1", "light", 3.0, 100))
    assert picked(q, 4.0, limit=1) == ["l1"]


def test_weights_scale_the_turns() -> None:
    cfg = AdmissionConfig(tenant_weights={"gold": 3.0})
    q = AdmissionQueue(cfg)
    for i in range(8):
        q.push(q.entry(f"g{i}", "gold", float(i), 100))
        q.push(q.entry(f"p{i}", "plain", float(i), 100))
    got = picked(q, 10.0, limit=8)
    assert sum(s.startswith("g") for s in got) == 6


def test_shortest_first_within_each_tenant() -> None:
    q = AdmissionQueue(CFG)
    q.push(q.entry("a_big", "a", 0.0, 900))
    q.push(q.entry("a_small", "a", 1.0, 100))
    q.push(q.entry("b_small", "b", 2.0, 50))
    order = [e.session for e in q.ordered(3.0, OrderMode.SHORTEST_FIRST)]
    assert order == ["a_small", "b_small", "a_big"]
    # a's big one does not fit: a is skipped, b still gets its turn.
    q.push(q.entry("b_big", "b", 3.0, 950))
    assert picked(q, 4.0, kv_overloaded=True, budget_blocks=20) == ["a_small", "b_small"]


def test_a_tenant_alone_may_fill_the_queue() -> None:
    q = AdmissionQueue(AdmissionConfig(queue_max=4))
    for i in range(3):
        assert q.push(q.entry(f"h{i}", "heavy", float(i), 100))  # alone: no share cap
    assert q.push(q.entry("l0", "light", 3.0, 100))
    assert not q.push(q.entry("l1", "light", 4.0, 100))
    assert q.refusal == "queue_full"
    q.remove("h0")
    q.remove("h1")
    assert q.push(q.entry("h3", "heavy", 5.0, 100))  # 1 of its share of 2 waits
    assert not q.push(q.entry("h4", "heavy", 5.0, 100))  # 2 of 2
    assert q.refusal == "tenant_over_share"
    assert q.push(q.entry("l1", "light", 6.0, 100))


def test_refusal_reasons() -> None:
    q = AdmissionQueue(AdmissionConfig(queue_max=4))
    assert q.push(q.entry("h0", "heavy", 0.0, 100))
    assert q.push(q.entry("h1", "heavy", 0.0, 100))
    assert q.push(q.entry("l0", "light", 0.0, 100))
    assert not q.push(q.entry("h2", "heavy", 0.0, 100))
    assert q.refusal == "tenant_over_share"
    assert q.push(q.entry("l1", "light", 0.0, 100))
    q2 = AdmissionQueue(AdmissionConfig(queue_max=20))
    for i in range(8):
        assert q2.push(q2.entry(f"i{i}", f"t{i}", 0.0, 100, "interactive"))
    for i in range(4):  # batch's share: 20 × 1/5
        assert q2.push(q2.entry(f"b{i}", f"u{i}", 0.0, 100, "batch"))
    assert not q2.push(q2.entry("b9", "u9", 0.0, 100, "batch"))
    assert q2.refusal == "class_over_share"


def test_retry_after_for_a_tenant_counts_its_own_backlog_at_its_share() -> None:
    q = AdmissionQueue(AdmissionConfig())
    for i in range(10):
        q.push(q.entry(f"s{i}", "a", float(i), 100))
    q.push(q.entry("x", "b", 0.0, 100))
    got = q.select(10.0, [worker(limit=10)])
    assert len(got) == 10
    for i in range(20):
        q.push(q.entry(f"t{i}", "a", 11.0, 100))
    q.push(q.entry("y", "b", 11.0, 100))
    rate = q.admission_rate(11.0)
    assert rate is not None and rate > 0
    whole = q.retry_after(11.0)  # 21 waiting at the whole rate
    mine = q.retry_after(11.0, tenant="a")  # 20 of its own at half of it
    assert whole < mine < 60  # within the clamp: the ratio shows
    assert q.retry_after(11.0, tenant="b") < whole  # 1 of its own at half the rate


def test_config_rejects_unknown_classes() -> None:
    with pytest.raises(ValidationError, match="unknown classes"):
        ServiceClasses(by_tenant={"abc": "gold"})
    with pytest.raises(ValidationError, match="default"):
        ServiceClasses(default="gold")
    with pytest.raises(ValidationError, match="aging_margin_s"):
        AdmissionConfig(classes=ServiceClasses(queue_deadline_s={"batch": 10.0}))
    with pytest.raises(ValidationError, match="tenant_weights"):
        AdmissionConfig(tenant_weights={"a": 0.0})


def test_the_first_class_fits_in_the_kv_later_classes_yield() -> None:
    q = AdmissionQueue(AdmissionConfig())
    assert q.push(q.entry("b0", "t", 0.0, 100, "batch"))  # 7 blocks
    assert q.push(q.entry("i0", "t", 0.0, 100, "interactive"))
    # The budget is spent by batch sessions; the first class's own budget has room for i0
    # alone: batch does not get it.
    assert picked(q, 1.0, admitted=3, budget_blocks=-20, protected_budget_blocks=10) == ["i0"]
    assert picked(q, 2.0, admitted=3, budget_blocks=-20, protected_budget_blocks=10) == []
    assert picked(q, 3.0, admitted=3, budget_blocks=7, protected_budget_blocks=10) == ["b0"]


def test_the_first_class_budget_shrinks_as_it_is_used() -> None:
    q = AdmissionQueue(AdmissionConfig())
    for i in range(3):
        assert q.push(q.entry(f"i{i}", "t", float(i), 100, "interactive"))  # 7 blocks each
    assert picked(q, 5.0, admitted=3, budget_blocks=0, protected_budget_blocks=14) == ["i0", "i1"]


def test_urgency_orders_a_tenants_own_sessions_not_one_tenant_before_another() -> None:
    cfg = AdmissionConfig(queue_deadline_s=60.0, tuning=AdmissionTuning(aging_margin_s=10.0))
    q = AdmissionQueue(cfg)
    q.push(q.entry("h_old", "heavy", 0.0, 900))
    q.push(q.entry("h_small", "heavy", 1.0, 100))
    q.charge("heavy", "x", 10_000)  # heavy was served far more
    q.push(q.entry("l0", "light", 50.0, 100))
    # h_old is within the margin of its deadline: it goes before heavy's smaller session, but
    # light, with the smaller counter, has its turn first.
    order = [e.session for e in q.ordered(55.0, OrderMode.SHORTEST_FIRST)]
    assert order == ["l0", "h_old", "h_small"]
