"""Forced tool choice: which requests force a call, and the call's arguments streamed piece by
piece joining to the whole (whatever the text, escapes included)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from marsproxy.emulator.openai_request import parse_request
from marsproxy.emulator.tool_calls import ForcedTool

TOOLS = [
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "edit", "parameters": {
        "type": "object", "properties": {"path": {}, "patch": {}}}}},
    {"type": "function", "function": {"name": "noargs"}},
]
MESSAGES = [{"role": "user", "content": "x"}]


def _tool(**extra: object) -> ForcedTool | None:
    return parse_request("chat", {"messages": MESSAGES, **extra}, "m").tool


def test_which_choices_force_a_call() -> None:
    assert _tool() is None and _tool(tools=TOOLS) is None  # tools alone: "auto"
    assert _tool(tools=TOOLS, tool_choice="auto") is None
    assert _tool(tools=TOOLS, tool_choice="none") is None
    assert _tool(tools=TOOLS, tool_choice="required") == ForcedTool("run", named=False)
    named = {"type": "function", "function": {"name": "edit"}}
    assert _tool(tools=TOOLS, tool_choice=named) == ForcedTool("edit", named=True, arg="path")
    named = {"type": "function", "function": {"name": "noargs"}}
    assert _tool(tools=TOOLS, tool_choice=named) == ForcedTool("noargs", named=True)
    # completions have no tools
    assert parse_request("completion", {"prompt": "x", "tool_choice": "required"}, "m").tool is None


def test_finish_reason_follows_vllm() -> None:
    required, named = ForcedTool("run", named=False), ForcedTool("run", named=True)
    assert required.finish_reason("stop") == "tool_calls"
    assert required.finish_reason("length") == "length"
    assert named.finish_reason("stop") == "stop" and named.finish_reason("length") == "length"


@given(st.lists(st.text(max_size=6), min_size=1, max_size=8), st.sampled_from(["command", "p"]))
def test_pieces_join_to_the_arguments(tokens: list[str], arg: str) -> None:
    tool = ForcedTool("run", named=False, arg=arg)
    last = len(tokens) - 1
    joined = "".join(tool.piece(t, i == 0, i == last) for i, t in enumerate(tokens))
    assert joined == tool.arguments("".join(tokens))
    assert json.loads(joined) == {arg: "".join(tokens)}
