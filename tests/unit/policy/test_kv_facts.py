"""Retention verified and the ledger corrected by the KV index (policy/kv_facts.py), and the
plane's use of them."""

from __future__ import annotations

from marsproxy.policy.kv_facts import correct_ledger, retention_outcome, verify_retention
from marsproxy.probes.kv_index import prediction_outcome
from marsproxy.sched.ledger import KvLedger


def test_retention_outcome_allows_the_last_block() -> None:
    assert retention_outcome(160, 176, 16) == "kept"  # the last block is always computed
    assert retention_outcome(176, 176, 16) == "kept"
    assert retention_outcome(80, 176, 16) == "partly_kept"
    assert retention_outcome(0, 176, 16) == "lost"
    assert retention_outcome(15, 176, 16) == "lost"


def test_prediction_outcome() -> None:
    assert prediction_outcome(320, 320, 16) == "exact"
    assert prediction_outcome(304, 320, 16) == "within_block"
    assert prediction_outcome(288, 320, 16) == "off"
    assert prediction_outcome(0, 320, 16) == "off"


def test_verify_names_the_reservation() -> None:
    ledger = KvLedger()
    r = ledger.reserve("s", "w0", 10, now=0.0, ttl_s=30.0, level=0)
    ev = verify_retention(5.0, r, "w0", 96, 16)
    assert ev is not None and (ev.session, ev.worker, ev.outcome) == ("s", "w0", "partly_kept")
    # Nothing retained, the call elsewhere, no index there: nothing to verify.
    assert verify_retention(5.0, None, "w0", 96, 16) is None
    assert verify_retention(5.0, r, "w1", 96, 16) is None
    assert verify_retention(5.0, r, "w0", None, 16) is None
    assert (ev.reserved_tokens, ev.resident_tokens) == (160, 96)


def test_the_ledger_keeps_only_what_the_engine_still_holds() -> None:
    ledger = KvLedger()
    ledger.reserve("a", "w0", 10, now=0.0, ttl_s=30.0, level=0)
    ledger.reserve("b", "w0", 10, now=0.0, ttl_s=30.0, level=0)
    ledger.reserve("c", "w0", 10, now=4.5, ttl_s=30.0, level=0)  # too young to judge
    ledger.reserve("d", "w1", 10, now=0.0, ttl_s=30.0, level=0)
    evs = correct_ledger(5.0, ledger, "w0", {"a": 4, "b": 12}, grace_s=1.0)
    assert [(e.session, e.reserved_blocks, e.resident_blocks) for e in evs] == [("a", 10, 4)]
    assert ledger.reserved_blocks("w0") == 4 + 10 + 10
    assert ledger.reserved_blocks("w1") == 10
    # A reservation never grows back.
    assert correct_ledger(6.0, ledger, "w0", {"a": 9, "b": 10, "c": 10}, grace_s=1.0) == []
