"""Which replies end a task: per tenant, once its replies have called tools."""

from __future__ import annotations

from marsproxy.core.answers import ReplyKind, ToolCallers


def test_an_answer_ends_a_task_only_for_tenants_seen_calling_tools() -> None:
    callers = ToolCallers()
    assert not callers.ends_task("a", ReplyKind.ANSWER)  # nothing seen of it: text agents too
    assert not callers.ends_task("a", ReplyKind.TOOL_CALL)
    assert "a" in callers and "b" not in callers
    assert callers.ends_task("a", ReplyKind.ANSWER)
    assert not callers.ends_task("a", None)  # cut short or unread: neither
    assert not callers.ends_task("b", ReplyKind.ANSWER)
