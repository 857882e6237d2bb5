"""KvLedger: reserve, expire, release on return, drop under pressure in priority order."""

from __future__ import annotations

import pytest

from marsproxy.sched.ledger import KvLedger


def test_reserve_and_count_per_worker() -> None:
    led = KvLedger()
    led.reserve("s1", "w1", 10, now=0.0, ttl_s=5.0, level=0)
    led.reserve("s2", "w1", 7, now=1.0, ttl_s=5.0, level=1)
    led.reserve("s3", "w2", 4, now=1.0, ttl_s=5.0, level=1)
    assert (led.reserved_blocks("w1"), led.reserved_blocks("w2")) == (17, 4)
    assert led.reserved_blocks("w3") == 0
    assert len(led) == 3
    r = led.reservation("s2")
    assert r is not None and (r.reserved_at, r.expires_at) == (1.0, 6.0)


def test_reserve_again_replaces() -> None:
    led = KvLedger()
    led.reserve("s1", "w1", 10, now=0.0, ttl_s=5.0, level=0)
    led.reserve("s1", "w1", 12, now=3.0, ttl_s=5.0, level=2)
    assert led.reserved_blocks("w1") == 12
    assert len(led) == 1


def test_expire_at_and_after_ttl() -> None:
    led = KvLedger()
    led.reserve("s1", "w1", 10, now=0.0, ttl_s=5.0, level=0)
    led.reserve("s2", "w1", 7, now=0.0, ttl_s=8.0, level=0)
    assert led.expire(4.99) == []
    gone = led.expire(5.0)
    assert [r.session for r in gone] == ["s1"]
    assert led.reserved_blocks("w1") == 7
    assert [r.session for r in led.expire(100.0)] == ["s2"]
    assert led.reserved_blocks("w1") == 0


def test_release_on_return() -> None:
    led = KvLedger()
    led.reserve("s1", "w1", 10, now=0.0, ttl_s=5.0, level=0)
    r = led.release_on_return("s1")
    assert r is not None and r.blocks == 10
    assert led.reserved_blocks("w1") == 0
    assert led.release_on_return("s1") is None


def test_drop_under_pressure_lowest_priority_then_oldest() -> None:
    led = KvLedger()
    led.reserve("hot", "w1", 50, now=0.0, ttl_s=60.0, level=0)
    led.reserve("old3", "w1", 5, now=1.0, ttl_s=60.0, level=3)
    led.reserve("new3", "w1", 20, now=2.0, ttl_s=60.0, level=3)
    led.reserve("mid", "w1", 30, now=0.5, ttl_s=60.0, level=1)
    led.reserve("other", "w2", 100, now=0.0, ttl_s=60.0, level=3)
    # need 22: old3 (5) then new3 (20) = 25 ≥ 22; level 1 and 0 keep theirs.
    dropped = led.drop_under_pressure("w1", 22)
    assert [r.session for r in dropped] == ["old3", "new3"]
    assert led.reserved_blocks("w1") == 80
    assert led.reserved_blocks("w2") == 100
    # need 31: mid (30) is not enough, hot goes too.
    assert [r.session for r in led.drop_under_pressure("w1", 31)] == ["mid", "hot"]
    assert led.reserved_blocks("w1") == 0


def test_drop_nothing_when_nothing_needed_and_all_when_too_few() -> None:
    led = KvLedger()
    led.reserve("a", "w1", 5, now=0.0, ttl_s=60.0, level=2)
    led.reserve("b", "w1", 5, now=1.0, ttl_s=60.0, level=0)
    assert led.drop_under_pressure("w1", 0) == []
    assert len(led) == 2
    assert [r.session for r in led.drop_under_pressure("w1", 1000)] == ["a", "b"]
    assert len(led) == 0


def test_reservations_listing_oldest_first() -> None:
    led = KvLedger()
    led.reserve("b", "w1", 1, now=2.0, ttl_s=5.0, level=0)
    led.reserve("a", "w2", 1, now=1.0, ttl_s=5.0, level=0)
    assert [r.session for r in led.reservations()] == ["a", "b"]
    assert [r.session for r in led.reservations("w1")] == ["b"]


@pytest.mark.parametrize(("blocks", "ttl"), [(-1, 5.0), (1, 0.0), (1, -2.0)])
def test_rejects_bad_reservations(blocks: int, ttl: float) -> None:
    with pytest.raises(ValueError):
        KvLedger().reserve("s", "w", blocks, now=0.0, ttl_s=ttl, level=0)
