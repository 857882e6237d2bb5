"""KV-fit arithmetic and the per-session prompt estimator."""

from __future__ import annotations

import pytest

from marsproxy.core.kv import (
    PromptEstimator,
    blocks_for_tokens,
    fits,
    free_blocks_from_usage,
    kv_budget,
    reprefill_seconds,
)


@pytest.mark.parametrize(
    ("tokens", "bs", "blocks"), [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (1000, 32, 32)]
)
def test_blocks_for_tokens(tokens: int, bs: int, blocks: int) -> None:
    assert blocks_for_tokens(tokens, bs) == blocks


def test_blocks_for_tokens_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError):
        blocks_for_tokens(10, 0)


def test_kv_budget() -> None:
    # 1000 free of 4000, 10 % reserve (400), 250 retained → 350.
    assert kv_budget(1000, 4000, 0.10, 250) == 350
    assert kv_budget(100, 4000, 0.10) == -300
    assert kv_budget(1000, 1005, 0.10) == 1000 - 101  # a partial reserve block is reserved


def test_fits() -> None:
    assert fits(10, 10) and not fits(11, 10)
    assert not fits(1, -5) and fits(0, 0)
    assert fits(10**9, None)  # no block counts: only the window limits


def test_estimator_uncorrected() -> None:
    est = PromptEstimator(4.0, history=64)
    assert est.estimate("s", 4000) == 1000
    assert est.estimate("s", 4001) == 1001
    assert est.correction("s") == 1.0


def test_estimator_corrected_by_usage() -> None:
    est = PromptEstimator(4.0, history=64)
    # 4000 chars were really 1500 tokens (code tokenizes densely): ratio 1.5 sticks.
    est.observe("s", 4000, 1500)
    assert est.correction("s") == 1.5
    assert est.estimate("s", 4000) == 1500
    assert est.estimate("s", 8000) == 3000
    est.observe("t", 4000, 1000)  # another session: its own ratio
    assert est.estimate("t", 4000) == 1000
    est.observe("s", 8000, 2000)  # the newest call wins
    assert est.estimate("s", 8000) == 2000
    est.forget("s")
    assert len(est) == 1


def test_a_new_session_is_estimated_from_the_latest_first_prompts() -> None:
    est = PromptEstimator(4.0, history=2)
    assert est.estimate("new", 4000) == 1000  # nothing seen: chars_per_token
    est.observe("a", 4000, 2000)
    assert est.estimate("new", 4000) == 2000 and est.correction("new") == 2.0
    est.observe("a", 4000, 4000)  # a later call of a: not a first prompt
    assert est.estimate("new", 4000) == 2000
    est.observe("b", 12000, 3000)  # Σ tokens / Σ raw over a's and b's first prompts
    assert est.estimate("new", 4000) == 1250
    est.observe("c", 4000, 500)  # history 2: a's first prompt leaves; never below 1
    assert est.estimate("new", 4000) == 1000
    assert est.estimate("a", 4000) == 4000  # a session's own ratio wins
    with pytest.raises(ValueError):
        PromptEstimator(4.0, history=0)


def test_estimator_ignores_useless_usage() -> None:
    est = PromptEstimator(4.0, history=64)
    est.observe("s", 0, 100)
    est.observe("s", 100, 0)
    assert len(est) == 0
    with pytest.raises(ValueError):
        PromptEstimator(0.0, history=64)


@pytest.mark.parametrize(
    ("usage", "total", "free"),
    [(0.0, 1000, 1000), (0.25, 1000, 750), (0.999, 1000, 1), (1.0, 1000, 0), (1.2, 1000, 0),
     (0.3, 10, 7), (None, 1000, None), (0.5, None, None)],
)
def test_free_blocks_from_usage(usage: float | None, total: int | None, free: int | None) -> None:
    assert free_blocks_from_usage(usage, total) == free


def test_reprefill_seconds() -> None:
    assert reprefill_seconds(3_000, 1_500.0) == 2.0
    assert reprefill_seconds(3_000, None) is None
