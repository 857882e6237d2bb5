"""Forced tool calls on the emulated ``/v1/responses`` (no I/O): which requests force one, and
the ``function_call`` output item it answers.

As on chat (``tool_calls.py``), the worker stands for a vLLM 0.32 started with
``--enable-auto-tool-choice --tool-call-parser ...``: a request whose ``tool_choice`` names a
function, or is ``"required"`` (the first tool), with ``tools`` gets one function call instead of
a message, its arguments wrapping the generated text (``{"command": "<text>"}``, the key being
the tool's first parameter). ``"auto"`` or ``"none"`` answers text. Checks and shapes follow
vLLM 0.32's ``ResponsesRequest.check_tool_usage`` and a real server's replies to a named choice
(fixtures ``vllm-0.32-responses-tool-call*``): the item ``{"arguments", "call_id":
"chatcmpl-tool-<16 hex>", "name", "type": "function_call", "id": "fc_<16 hex>", "async",
"caller", "namespace", "status"}``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from marsproxy.emulator.openai_api import ApiError, validation_error
from marsproxy.emulator.tool_calls import ForcedTool, first_param


def forced_tool(body: Mapping[str, Any]) -> ForcedTool | None:
    """The function call a Responses body forces (``None``: answer text); raises
    :class:`ApiError` as vLLM's validator does."""
    tools = body.get("tools")
    named = [(str(t.get("name")), first_param(t.get("parameters"))) for t in tools or ()
             if isinstance(t, Mapping) and t.get("type") == "function"]
    choice = body.get("tool_choice", "auto")
    if choice == "required":
        if not tools:
            raise validation_error(
                "Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice")
        return ForcedTool(named[0][0], named=False, arg=named[0][1]) if named else None
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        for name, arg in named:
            if name == choice.get("name"):
                return ForcedTool(name, named=True, arg=arg)
        raise not_in_tools()
    return None


def not_in_tools() -> ApiError:
    return validation_error("Tool choice 'function' not found in 'tools' parameter.",
                            "tool_choice")


def echoed_choice(body: Mapping[str, Any]) -> Any:
    """``tool_choice`` as vLLM echoes it: ``"none"`` without tools, a named one as its model
    dumps it (``name``, then ``type``)."""
    if not body.get("tools"):
        return "none"
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"name": choice.get("name"), "type": "function"}
    return choice


def call_ids() -> tuple[str, str]:
    """(call_id, item id) of a new function call, as vLLM 0.32 makes them."""
    return "chatcmpl-tool-" + uuid.uuid4().hex[:16], "fc_" + uuid.uuid4().hex[:16]


def function_call_item(tool: ForcedTool, call_id: str, item_id: str, arguments: str,
                       done: bool) -> dict[str, Any]:
    """The output item, in vLLM's field order; ``done``: ``completed`` (else ``in_progress``)."""
    return {"arguments": arguments, "call_id": call_id, "name": tool.name,
            "type": "function_call", "id": item_id, "async": None, "caller": None,
            "namespace": None, "status": "completed" if done else "in_progress"}


def call_message(tool: ForcedTool, call_id: str, arguments: str) -> dict[str, Any]:
    """The assistant message a continuation renders for the call (as a ``function_call``
    input item)."""
    return {"role": "assistant", "tool_calls": [{"id": call_id, "type": "function", "function": {
        "name": tool.name, "arguments": arguments}}]}
