"""The global queue's score: lane, class, tenant counter, then arrival, in one exact float."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from marsproxy.policy.outcome import Pending
from marsproxy.policy.rank import EPOCH_MS, RankKey, rank_keys, tenant_term

T0 = EPOCH_MS + 700 * 86_400_000  # late 2026


def _rank(cls: str) -> int:
    return {"interactive": 0, "batch": 1}[cls]


def test_children_then_classes_then_tenants_then_arrival() -> None:
    child_batch = RankKey(0, 500).score(T0 + 10_000)
    interactive_heavy = RankKey(1, 400).score(T0)
    interactive_light = RankKey(1, 3).score(T0 + 5_000)
    batch_new = RankKey(2, 0).score(T0 - 50_000)
    assert child_batch < interactive_light < interactive_heavy < batch_new
    assert RankKey(1, 3).score(T0) < RankKey(1, 3).score(T0 + 100)


@given(st.integers(0, 15), st.integers(0, (1 << 17) - 1), st.integers(0, 10**13))
def test_a_score_is_an_exact_integer_in_a_double(band: int, tenant: int, arrival: int) -> None:
    s = RankKey(band, tenant).score(EPOCH_MS + arrival)
    assert 0 <= s < 2**53 and int(float(s)) == s


@given(st.floats(0, 1e15), st.floats(0, 1e15))
def test_the_tenant_term_is_monotone(a: float, b: float) -> None:
    lo, hi = sorted((a, b))
    assert tenant_term(lo) <= tenant_term(hi)


def test_a_tenants_pending_sessions_interleave_with_a_lighter_one() -> None:
    pending = [
        ("h1", Pending("w0", 0.0, tenant="h", cls="interactive", est_tokens=1000)),
        ("h2", Pending("w0", 1.0, tenant="h", cls="interactive", est_tokens=1000)),
        ("l1", Pending("w0", 2.0, tenant="l", cls="interactive", est_tokens=1000)),
        ("c", Pending("w0", 3.0, tenant="h", cls="batch", child=True, est_tokens=10)),
    ]
    keys = rank_keys(pending, {"h": 1000.0, "l": 1500.0}, _rank, lambda t, n: float(n))
    assert keys["h1"].tenant < keys["l1"].tenant < keys["h2"].tenant
    assert keys["c"].band == 0 and keys["l1"].band == 1
