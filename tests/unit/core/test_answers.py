"""Which replies end a task: per tenant, once its replies have called tools, unless its
sessions come straight back after their answers."""

from __future__ import annotations

import pytest

from marsproxy.core.answers import AnswerTally, ReplyKind


def test_an_answer_ends_a_task_only_for_tenants_seen_calling_tools() -> None:
    tally = AnswerTally(history=4, window_s=20.0)
    assert not tally.ends_task("a", ReplyKind.ANSWER)  # nothing seen of it: text agents too
    assert not tally.ends_task("a", ReplyKind.TOOL_CALL)
    assert "a" in tally and "b" not in tally
    assert tally.ends_task("a", ReplyKind.ANSWER)
    assert not tally.ends_task("a", None)  # an error, a broken stream: neither
    assert not tally.ends_task("b", ReplyKind.ANSWER)


def test_a_tenant_whose_sessions_come_straight_back_keeps_them() -> None:
    # A harness that answers a tool-less reply itself ("please continue") comes back at once.
    tally = AnswerTally(history=4, window_s=20.0)
    tally.ends_task("h", ReplyKind.TOOL_CALL)
    tally.answered("s1", "h", now=10.0)
    tally.arrived("s1", now=10.5)
    assert tally.goes_on("h") and not tally.ends_task("h", ReplyKind.ANSWER)
    # Answers are watched all the same; once most of the latest were not back, they end again.
    for i, at in enumerate((20.0, 50.0, 80.0)):
        tally.answered(f"t{i}", "h", now=at)
        tally.expire(at + 20.5)
    assert not tally.goes_on("h") and tally.ends_task("h", ReplyKind.ANSWER)
    # A return later than the window is a new task (a person's next instruction), not a return.
    tally.answered("u", "h", now=200.0)
    tally.arrived("u", now=230.0)
    assert not tally.goes_on("h")
    tally.arrived("never-answered", now=231.0)  # nothing watched: nothing recorded
    tally.expire(1000.0)
    assert not tally.goes_on("h")


def test_only_tool_calling_tenants_are_watched() -> None:
    tally = AnswerTally(history=4, window_s=20.0)
    tally.answered("s", "text", now=0.0)
    tally.arrived("s", now=1.0)
    assert not tally.goes_on("text")
    with pytest.raises(ValueError):
        AnswerTally(history=0, window_s=1.0)
