"""TenantShares: virtual token counters, admission credits, the virtual time."""

from __future__ import annotations

from marsproxy.aimd.shares import TenantShares


def test_counters_divide_served_tokens_by_weight() -> None:
    s = TenantShares({"gold": 4.0})
    s.charge("gold", "g1", 400)
    s.charge("plain", "p1", 400)
    assert s.tag("gold") == 100.0
    assert s.tag("plain") == 400.0


def test_admission_credit_is_not_charged_twice() -> None:
    s = TenantShares()
    s.admitted("a", "s1", 1000)
    assert s.tag("a") == 1000.0
    # The first response served 800 uncached prompt tokens and 100 completion tokens: the credit
    # of 1000 covers them, so nothing more is charged...
    s.charge("a", "s1", 900)
    assert s.tag("a") == 1000.0
    # ...and the next response is charged net of the 100 left.
    s.charge("a", "s1", 300)
    assert s.tag("a") == 1200.0
    s.forget("s1")
    s.charge("a", "s1", 50)  # a late report after the end is charged in full
    assert s.tag("a") == 1250.0


def test_a_credit_belongs_to_its_tenant() -> None:
    s = TenantShares()
    s.admitted("a", "s1", 1000)
    s.charge("b", "s1", 300)  # same session name under another tenant: no credit
    assert s.tag("b") == 300.0


def test_a_returning_idle_tenant_starts_at_the_virtual_time() -> None:
    s = TenantShares()
    s.activate("heavy")
    for i in range(10):
        s.admitted("heavy", f"h{i}", 1000)
    s.settle(["heavy"])  # heavy waits still: the virtual time follows its counter
    assert s.virtual_time == 10_000.0
    s.activate("light")  # never served: no burst of 10 000 tokens' credit
    assert s.tag("light") == 10_000.0


def test_without_contention_there_is_no_debt() -> None:
    s = TenantShares()
    s.admitted("a", "a1", 5000)
    s.settle([])  # nobody waits: the virtual time catches up with everyone
    s.activate("a")
    s.activate("b")
    assert s.tag("a") == s.tag("b") == 5000.0
    assert len(s) == 0  # counters at the virtual time are not kept


def test_virtual_time_never_goes_back() -> None:
    s = TenantShares()
    s.admitted("a", "a1", 100)
    s.settle(["a"])
    s.settle(["b"])  # b's counter reads as the virtual time
    assert s.virtual_time == 100.0


def test_charges_are_kept_for_the_store_only_when_shared() -> None:
    s = TenantShares({"gold": 2.0})
    s.charge("gold", "g1", 400)
    assert s.take_charges() == {}  # one replica: nothing to send
    s.shared = True
    s.charge("gold", "g1", 400)
    s.charge("plain", "p1", 100)
    assert s.take_charges() == {"gold": 200.0, "plain": 100.0}
    assert s.take_charges() == {}


def test_sync_adds_what_other_replicas_charged_and_not_our_own() -> None:
    s = TenantShares()
    s.shared = True
    s.sync({"a": 1000.0}, {})  # the first read is the baseline
    base = s.tag("a")
    s.charge("a", "s1", 300)
    sent = s.take_charges()
    # The store added ours (300) and another replica's (500) since the last read.
    s.sync({"a": 1800.0}, sent)
    assert s.tag("a") == base + 300 + 500
    assert s.counters() == {"a": 1800.0}


def test_charges_wait_while_the_store_is_away_and_a_lost_store_lowers_nothing() -> None:
    s = TenantShares()
    s.shared = True
    s.sync({"a": 1000.0}, {})
    s.charge("a", "s1", 300)
    sent = s.take_charges()
    s.restore(sent)  # unreachable: they go with the next exchange
    assert s.counters() == {"a": 1300.0}
    before = s.tag("a")
    sent = s.take_charges()
    s.sync({"a": 300.0}, sent)  # Redis restarted empty: only our resent charges are there
    assert s.tag("a") == before
    assert s.counters() == {"a": 300.0}
