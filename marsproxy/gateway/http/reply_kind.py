"""Whether a worker's reply called a tool or answered (``core/answers.py``), read from the
OpenAI chat and completions, Responses and Anthropic messages shapes, whole or streamed.

A reply calls a tool when it carries one, whatever its finish reason says (vLLM ends a call to a
named function with ``stop``, a call cut at ``max_tokens`` with ``length``). It answers when it
finished and carries none, cut at ``max_tokens`` too: agent loops end on a reply without a tool
call whatever stopped it. A reply whose end was not seen (an error, a broken stream, a shape not
known, a background response still queued) is neither. Only a request that offered tools is an
agent loop's call: the reply to one that offered none (a harness's side request under the same
session: a title, a summary, a safety check) says nothing of the loop's end, and is not read for
it (``kinds`` in ``sse.py``).
"""

from __future__ import annotations

from typing import Any

from marsproxy.core.answers import ReplyKind

_TOOL_FINISHES = frozenset({"tool_calls", "function_call", "tool_use"})


def kind_of(calls_tool: bool, finish: object) -> ReplyKind | None:
    """``finish``: the finish or stop reason (a Responses status), ``None`` when unseen."""
    if calls_tool:
        return ReplyKind.TOOL_CALL
    if not isinstance(finish, str) or not finish:  # a worker's list or object is no reason
        return None
    return ReplyKind.TOOL_CALL if finish in _TOOL_FINISHES else ReplyKind.ANSWER


def offers_tools(body: dict[str, Any]) -> bool:
    """Whether a request offered tools (``tools``, or the older ``functions``)."""
    return bool(body.get("tools") or body.get("functions"))


def first_choice(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The choice a client continues with (``n`` > 1: the first)."""
    choices = obj.get("choices")
    for ch in choices if isinstance(choices, list) else ():
        if isinstance(ch, dict) and ch.get("index", 0) == 0:
            return ch
    return None


def body_kind(route: str, obj: dict[str, Any]) -> ReplyKind | None:
    """A whole (non-streamed) reply's kind."""
    if route == "responses":
        return responses_kind(obj)
    if route == "messages":
        blocks = obj.get("content")
        calls = isinstance(blocks, list) and any(
            isinstance(b, dict) and b.get("type") == "tool_use" for b in blocks)
        return kind_of(calls, obj.get("stop_reason"))
    ch = first_choice(obj)
    if ch is None:
        return None
    msg = ch.get("message")
    return kind_of(isinstance(msg, dict) and bool(msg.get("tool_calls")), ch.get("finish_reason"))


RESPONSE_ENDS = frozenset({"completed", "incomplete"})
"""The statuses of a Responses object that ended with a reply (not failed, cancelled, running)."""


def responses_kind(resp: dict[str, Any]) -> ReplyKind | None:
    """A Responses API response object's kind: function calls among its output items, once its
    status, ``completed`` or ``incomplete``, says it ended. Any other is neither: ``queued`` or
    ``in_progress`` (a ``background`` response, still generating on the worker), ``failed``,
    ``cancelled``."""
    status = resp.get("status")
    if status not in RESPONSE_ENDS:
        return None
    items = resp.get("output")
    calls = isinstance(items, list) and any(
        isinstance(i, dict) and i.get("type") == "function_call" for i in items)
    return kind_of(calls, status)
