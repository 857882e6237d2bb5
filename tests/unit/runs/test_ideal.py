"""The ideal (alone, idle) LLM time computed from the profile equals the engine run alone."""

from __future__ import annotations

import pytest

from marsproxy.emulator.engine import Engine
from marsproxy.emulator.profiles import get_profile
from marsproxy.emulator.tokenizer import filler_token_id
from marsproxy.runs.ideal import ideal_seconds, llm_call_seconds
from marsproxy.runs.workload import PlannedSession, PlannedTurn


def _engine_alone(profile_name: str, session: PlannedSession) -> float:
    eng = Engine(get_profile(profile_name))
    now = 0.0
    tokens = [1, 2, 3]
    for i, turn in enumerate(session.turns):
        tokens = tokens + [5] * (turn.input_tokens - len(tokens))
        eng.add_request(f"r{i}", tokens, turn.output_tokens, ignore_eos=True, now=now)
        while eng.has_work():
            now += eng.step(now).duration
        tokens = tokens + [filler_token_id(j) for j in range(turn.output_tokens)]
    return now


@pytest.mark.parametrize("profile", ["tiny", "h200-qwen3-coder-30b-a3b"])
def test_ideal_llm_time_matches_the_engine_alone(profile: str) -> None:
    turns = (PlannedTurn(1500, 40, 2.0, "test"), PlannedTurn(1700, 1, 0.5, "read"),
             PlannedTurn(2300, 120, None, "other"))
    session = PlannedSession("s", "s", 0.0, turns)
    llm, tool = ideal_seconds(session, get_profile(profile))
    assert tool == pytest.approx(2.5)
    assert llm == pytest.approx(_engine_alone(profile, session), rel=1e-9)
    scaled, _ = ideal_seconds(session, get_profile(profile), time_scale=3.0)
    assert scaled == pytest.approx(3 * llm)


def test_cached_prefix_makes_a_call_cheaper() -> None:
    prof = get_profile("h200-qwen3-coder-30b-a3b")
    cold = llm_call_seconds(prof, 100_000, 0, 100)
    warm = llm_call_seconds(prof, 100_000, 99_000, 100)
    assert warm < cold / 5
