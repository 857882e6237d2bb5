"""Whether a tenant's sessions come back after their first call (core/returns.py)."""

from __future__ import annotations

import pytest

from marsproxy.core.returns import ReturnTally


def test_nothing_seen_is_not_likely() -> None:
    assert not ReturnTally(4, 32).likely("t")


def test_at_least_half_came_back_is_likely_per_tenant() -> None:
    r = ReturnTally(4, 32)
    r.record("a", True)
    r.record("a", False)
    r.record("b", False)
    assert r.likely("a") and not r.likely("b")
    r.record("a", False)
    assert not r.likely("a")  # 1 of 3
    assert r.rates() == {"a": (1, 3, 0), "b": (0, 1, 0)}


def test_only_the_latest_are_remembered() -> None:
    r = ReturnTally(3, 32)
    for back in (False, False, False, True, True):
        r.record("t", back)
    assert r.likely("t") and r.rates()["t"] == (2, 3, 0)  # the first two are forgotten
    for _ in range(2):
        r.record("t", False)
    assert not r.likely("t") and r.rates()["t"] == (1, 3, 0)


def test_one_shot_only_on_a_full_history_mostly_not_back() -> None:
    r = ReturnTally(4, 32)
    assert not r.one_shot("t")  # nothing seen
    for _ in range(3):
        r.record("t", False)
    assert not r.one_shot("t") and not r.likely("t")  # too little seen to say
    r.record("t", False)
    assert r.one_shot("t")
    r.record("t", True)
    assert r.one_shot("t")  # 1 of 4
    r.record("t", True)
    assert not r.one_shot("t") and r.likely("t")  # 2 of 4
    assert not r.one_shot("other")


def test_a_crowd_in_a_first_gap_none_back_is_one_shot_until_one_is() -> None:
    r = ReturnTally(4, 3)
    for _ in range(2):
        r.gap_opened("t")
    r.gap_opened("other")
    assert not r.one_shot("t")  # 2 open: too few to say
    r.gap_opened("t")
    assert r.one_shot("t") and not r.one_shot("other")
    assert r.rates() == {"t": (0, 0, 3), "other": (0, 0, 1)}
    r.gap_closed("t")
    assert not r.one_shot("t")  # 2 open again
    r.gap_opened("t")
    r.record("t", False)  # judged: not back; still none back
    assert r.one_shot("t")
    r.record("t", True)  # one came back: its sessions may be agents
    assert not r.one_shot("t") and r.likely("t")
    for _ in range(3):
        r.gap_closed("t")
    assert r.rates() == {"t": (1, 2, 0), "other": (0, 0, 1)}


@pytest.mark.parametrize(("history", "crowd"), [(0, 1), (1, 0)])
def test_history_and_crowd_must_hold_one(history: int, crowd: int) -> None:
    with pytest.raises(ValueError, match="history and crowd"):
        ReturnTally(history, crowd)
