"""Forced tool calls on the emulated worker: which requests force one, and its shapes (no I/O).

The emulated worker stands for a vLLM 0.32 started with ``--enable-auto-tool-choice
--tool-call-parser ...``. A chat request whose ``tool_choice`` is ``"required"`` or a named
function (with ``tools``) gets one tool call instead of text: the named function (for
"required", the first tool) with arguments that wrap the generated text, ``{"command":
"<text>"}``, the key being the tool's first parameter. The engine runs as for text (same tokens,
same pacing); only the wrapping changes. ``"auto"`` (vLLM's default when ``tools`` are sent),
``"none"`` or no tools answer text, as a model that chose not to call a tool.

Shapes follow vLLM 0.32: ``chat_completion/serving.py`` (the message with ``content: ""`` and
``tool_calls``; ``finish_reason`` "tool_calls" for "required" when the model stopped, the
engine's otherwise), and a stream captured from a real vLLM 0.32.0
(``tests/fixtures/vllm-0.32-chat-stream-tool-call.txt``): ``content: null`` beside the calls, a
delta that names the call (``id`` ``chatcmpl-tool-<16 hex>``, ``type``, ``index``,
``function.name``, no arguments), then deltas that append ``function.arguments`` at ``index`` 0.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ToolChoiceError(ValueError):
    """vLLM's ``VLLMValidationError`` from the request's tool checks: a message and the
    parameter it names (answered as vLLM answers one: 400 ``BadRequestError``)."""

    def __init__(self, message: str, parameter: str) -> None:
        super().__init__(message)
        self.message = message
        self.parameter = parameter


@dataclass(frozen=True)
class ForcedTool:
    """A tool call the reply must be (``tool_choice`` "required" or a named function)."""

    name: str
    named: bool  # a named function (finish_reason stays the engine's) rather than "required"
    arg: str = "command"  # the argument that carries the generated text

    def arguments(self, text: str) -> str:
        """The whole arguments string: a JSON object whose one value is the generated text."""
        return json.dumps({self.arg: text})

    def piece(self, text: str, first: bool, last: bool) -> str:
        """The arguments' text streamed with one generated token: the token's text (escaped as
        in a JSON string), after ``{"command": "`` on the first token and before ``"}`` on the
        last, so that the pieces join to :meth:`arguments` of the whole text."""
        out = json.dumps(text)[1:-1]
        if first:
            out = json.dumps({self.arg: ""})[:-2] + out
        return out + '"}' if last else out

    def finish_reason(self, engine_reason: str) -> str:
        """vLLM's finish_reason: "tool_calls" for "required" when the model stopped by itself,
        the engine's otherwise (a named call keeps "stop"; a cut one keeps "length")."""
        return "tool_calls" if not self.named and engine_reason == "stop" else engine_reason


_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def _tool_names(tools: Any) -> list[tuple[str, str]]:
    """(name, first parameter) of each function tool."""
    if not isinstance(tools, list):
        raise ToolChoiceError("Input should be a valid list", "tools")
    out: list[tuple[str, str]] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ToolChoiceError("Field required", f"tools.{i}.function.name")
        out.append((fn["name"], first_param(fn.get("parameters"))))
    return out


def first_param(schema: Any) -> str:
    """The argument that carries the generated text: the schema's first property."""
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    if isinstance(props, Mapping) and props:
        return str(next(iter(props)))
    return "command"


def parse_tool_choice(body: Mapping[str, Any]) -> ForcedTool | None:
    """The tool call a chat body forces (``None``: answer text), validated as vLLM 0.32's
    ``ChatCompletionRequest.check_tool_usage`` does; raises :class:`ToolChoiceError`."""
    tools = body.get("tools")
    if tools == []:
        raise ToolChoiceError(
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely.", "tools")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice is None or choice == "none":
        return None
    if tools is None:
        raise ToolChoiceError(
            "When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, Mapping):
        raise ToolChoiceError(
            f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" "
            'or "required" are supported.', "tool_choice")
    names = _tool_names(tools)
    if isinstance(choice, Mapping):
        return _named_tool(choice, names)
    if choice == "auto":
        # vLLM lets the model decide (with --enable-auto-tool-choice); the emulated model always
        # answers in text. (A vLLM started without that flag answers 400 instead.)
        return None
    return ForcedTool(names[0][0], named=False, arg=names[0][1])  # "required": the first tool


def _named_tool(choice: Mapping[str, Any], names: list[tuple[str, str]]) -> ForcedTool:
    fn = choice.get("function")
    if not isinstance(fn, Mapping):
        raise ToolChoiceError(
            f"Invalid value for `function`: `{fn}` in `tool_choice`! {_NAMED_USAGE}",
            "tool_choice.function")
    if "name" not in fn:
        raise ToolChoiceError(
            f"Expected field `name` in `function` in `tool_choice`! {_NAMED_USAGE}",
            "tool_choice.function.name")
    name = fn["name"]
    if not isinstance(name, str) or not name:
        raise ToolChoiceError(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_NAMED_USAGE}",
            "tool_choice.function.name")
    for tool_name, arg in names:
        if tool_name == name:
            return ForcedTool(name, named=True, arg=arg)
    raise ToolChoiceError(
        "The tool specified in `tool_choice` does not match any of the specified `tools`",
        "tool_choice")


def tool_call_id() -> str:
    """A tool call's id as vLLM 0.32 makes it (16 random hex digits)."""
    return "chatcmpl-tool-" + uuid.uuid4().hex[:16]


def tool_chunk(
    rid: str, created: int, model: str, tool: ForcedTool, arguments: str,
    call_id: str | None = None, finish_reason: str | None = None, index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A streamed chat chunk of the tool call, keyed as vLLM 0.32's deltas: with ``call_id``
    the one that names the call (id, type, index, name; ``arguments`` unused), else one that
    appends ``arguments`` at ``index`` 0; ``index`` is the choice's; ``logprobs``: its
    token's."""
    call: dict[str, Any]
    if call_id is not None:
        call = {"id": call_id, "type": "function", "index": 0, "function": {"name": tool.name}}
    else:
        call = {"index": 0, "function": {"arguments": arguments}}
    choice: dict[str, Any] = {
        "index": index, "delta": {"content": None, "tool_calls": [call]}, "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = None
    return {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [choice],
    }


def tool_call(tool: ForcedTool, call_id: str, text: str) -> dict[str, Any]:
    """The non-streamed ``message.tool_calls`` entry whose arguments wrap ``text``."""
    return {"id": call_id, "type": "function",
            "function": {"name": tool.name, "arguments": tool.arguments(text)}}
