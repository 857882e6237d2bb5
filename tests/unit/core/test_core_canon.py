"""Histories and session ids read from bodies of any shape: what a client sends that the proxy
does not understand is no history (or no id), never an exception (a 500 on the request)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from marsproxy.core.identity import Route, claude_code_session, history_of

DEEP = "[" * 100_000 + "]" * 100_000  # a JSON text nested deeper than the parser's stack


@pytest.mark.parametrize("calls", [5, True, 1.5, "abc", {"a": 1}])
def test_tool_calls_of_the_wrong_type_are_no_calls(calls: Any) -> None:
    msgs = [{"role": "assistant", "content": "x", "tool_calls": calls}]
    plain = history_of("chat", {"messages": [{"role": "assistant", "content": "x"}]})
    got = history_of("chat", {"messages": msgs})
    assert got is not None and plain is not None and got.key() == plain.key()


@pytest.mark.parametrize(("route", "body"), [
    ("chat", {"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "a", "arguments": DEEP}}]}]}),
    ("messages", {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "name": "a", "input": DEEP}]}]}),
    ("responses", {"input": [{"type": "function_call", "name": "a", "arguments": DEEP}]}),
])
def test_tool_arguments_nested_too_deep_are_kept_as_text(route: Route, body: Any) -> None:
    h = history_of(route, body)
    assert h is not None and h.length == 1


def test_a_message_too_deep_to_canonicalize_is_no_history() -> None:
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    assert history_of("chat", {"messages": [deep]}) is None


def test_a_metadata_user_id_nested_too_deep_is_no_session() -> None:
    assert claude_code_session({"user_id": "{" + '"a":' + DEEP + "}"}) is None
    assert claude_code_session({"user_id": json.dumps({"session_id": "s"})}) == "s"
