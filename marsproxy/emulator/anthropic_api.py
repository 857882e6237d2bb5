"""Anthropic Messages API (``/v1/messages``) request parsing and response shapes, as vLLM 0.32
serves them (no I/O).

vLLM turns a Messages request into a chat-completions request (system text first, text blocks
joined, ``tool_use`` blocks as ``tool_calls``, ``tool_result`` blocks as ``tool`` messages) and
renders that through the chat template; the emulator does the same, so a Messages history hits
the prefix cache exactly like the equivalent chat history does. Field validation fails with
vLLM's OpenAI-shaped 400 (``type: "Bad Request"``, ``param: "body.<field>"``); errors raised
while serving (unknown model, prompt too long) come in Anthropic's shape
``{"type": "error", "error": {"type", "message"}}``.

Tool calls: vLLM maps ``tool_choice`` ``{"type": "any"}`` to the chat request's ``"required"``
and ``{"type": "tool", "name"}`` to a named function; the reply is then one ``tool_use`` block
(its id the chat tool call's, ``chatcmpl-tool-<hex>``; ``input`` wraps the generated text) with
``stop_reason`` mapped from the chat ``finish_reason``: ``"tool_use"`` for "any" when the model
stopped by itself, ``"end_turn"`` for a named tool, ``"max_tokens"`` when cut.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from marsproxy.core.lax_bool import LAX_BOOL
from marsproxy.emulator.openai_api import ApiError
from marsproxy.emulator.openai_request import ParsedRequest
from marsproxy.emulator.tokenizer import PromptError, encode_chat
from marsproxy.emulator.tool_calls import ForcedTool, first_param

_ROLES = frozenset({"user", "assistant", "system"})
_BLOCK_TYPES = frozenset({
    "text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
    "redacted_thinking", "tool_addition", "tool_removal",
})
# Claude Code's attribution block carries a per-request hash; vLLM drops it from the prompt so
# that it does not defeat prefix caching.
_BILLING_PREFIX = "x-anthropic-billing-header"


class AnthropicError(ApiError):
    """An error vLLM answers in Anthropic's shape (raised while serving, not validating)."""

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.err_type, "message": self.message}}


def invalid(field: str, msg: str, kind: str, value: Any = None) -> ApiError:
    """vLLM's answer to a body that fails validation: the OpenAI shape, type ``Bad Request``,
    the message in pydantic's words (containers summarized, values as strings)."""
    if isinstance(value, (list, dict, Mapping)):
        shown = f"<{'list' if isinstance(value, list) else 'dict'} of {len(value)} items>"
    else:
        shown = str(value)
    err = {"type": kind, "loc": f"body.{field}", "msg": msg, "input": shown}
    return ApiError(400, f"1 validation error:\n  {err}", "Bad Request", f"body.{field}")


def not_found(name: str, served: str) -> AnthropicError:
    return AnthropicError(
        404, f"The model `{name}` does not exist. Valid aliases: {served}.", "NotFoundError"
    )


EMPTY_CONVERSATION = (
    "Cannot apply chat template to an empty conversation. Provide at least one message."
)


@dataclass(frozen=True)
class MessagesRequest:
    parsed: ParsedRequest
    chat_messages: list[dict[str, Any]]


def parse_messages(body: Any, served_model: str, *, count_only: bool = False) -> MessagesRequest:
    """Validate a Messages (or ``count_tokens``) body; raises :class:`ApiError`."""
    if not isinstance(body, Mapping):
        raise invalid("", "Input should be a valid dictionary", "model_attributes_type", body)
    model = body.get("model")
    if not isinstance(model, str):
        raise _missing_or_type("model", model, "string", body)
    if not model:
        raise invalid("model", "Value error, Model is required", "value_error", model)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _missing_or_type("messages", messages, "list", body)
    max_tokens: int | None = None
    if not count_only:
        raw_max = body.get("max_tokens")
        if isinstance(raw_max, bool) or not isinstance(raw_max, int):
            raise _missing_or_type("max_tokens", raw_max, "integer", body)
        if raw_max <= 0:
            raise invalid("max_tokens", "Value error, max_tokens must be positive",
                          "value_error", raw_max)
        max_tokens = raw_max
    try:  # vLLM's model reads it in pydantic's lax mode: "true", 1 ... stream
        stream = body.get("stream") is not None and LAX_BOOL.validate_python(body["stream"])
    except ValidationError as exc:
        err = exc.errors()[0]
        raise invalid("stream", err["msg"], err["type"], body["stream"]) from None
    tool = _forced_tool(body)
    chat = to_chat_messages(body.get("system"), messages)
    if model != served_model:
        raise not_found(model, served_model)
    if not chat:
        raise AnthropicError(400, EMPTY_CONVERSATION, "BadRequestError")
    try:
        ids = encode_chat(chat)
    except PromptError as exc:
        raise AnthropicError(400, str(exc), "BadRequestError") from exc
    return MessagesRequest(
        ParsedRequest(
            kind="chat", model=model, prompt_token_ids=ids, max_tokens=max_tokens,
            ignore_eos=False, priority=0, stream=bool(stream), include_usage=bool(stream),
            tool=tool,
        ),
        chat,
    )


_TOOL_CHOICES = ("auto", "any", "tool", "none")


def _forced_tool(body: Mapping[str, Any]) -> ForcedTool | None:
    """The tool call ``tool_choice`` forces (``None``: answer text). vLLM validates the Messages
    request's own fields (``tools`` entries, ``tool_choice.type``, the name of a "tool" choice)
    but not the converted chat request's tool usage, so "any" or "tool" with no ``tools`` is not
    a 400 there; the emulator answers those in text."""
    tools = body.get("tools")
    params: dict[str, str] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools", "Input should be a valid list", "list_type", tools)
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise invalid(f"tools.{i}", "Input should be a valid dictionary",
                              "model_type", tool)
            name, schema = tool.get("name"), tool.get("input_schema")
            if not isinstance(name, str):
                raise _missing_or_type(f"tools.{i}.name", name, "string", tool, "name")
            if "input_schema" not in tool:
                raise invalid(f"tools.{i}.input_schema", "Field required", "missing", tool)
            if not isinstance(schema, Mapping):
                raise invalid(f"tools.{i}.input_schema", "Input should be a valid dictionary",
                              "dict_type", schema)
            params.setdefault(name, first_param(schema))
    choice = body.get("tool_choice")
    if choice is None:
        return None
    if not isinstance(choice, Mapping):
        raise invalid("tool_choice", "Input should be a valid dictionary", "model_type", choice)
    kind = choice.get("type")
    if kind not in _TOOL_CHOICES:
        if "type" not in choice:
            raise invalid("tool_choice.type", "Field required", "missing", choice)
        raise invalid("tool_choice.type", "Input should be 'auto', 'any', 'tool' or 'none'",
                      "literal_error", kind)
    name = choice.get("name")
    if kind == "tool" and not name:
        raise invalid("tool_choice", "Value error, tool_choice.name is required when type is "
                      "'tool'", "value_error", choice)
    if not tools or kind in ("auto", "none"):
        return None  # "auto": the emulated model chooses to answer in text
    if kind == "any":
        first = tools[0]["name"]
        return ForcedTool(first, named=False, arg=params[first])
    return ForcedTool(str(name), named=True, arg=params.get(str(name), "command"))


def _missing_or_type(
    field: str, value: Any, kind: str, body: Mapping[str, Any], key: str | None = None
) -> ApiError:
    if (key or field) not in body:
        return invalid(field, "Field required", "missing", body)
    return invalid(field, f"Input should be a valid {kind}", f"{kind}_type", value)


def _blocks(field: str, content: Any) -> list[Mapping[str, Any]] | str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(field, "Input should be a valid string or list", "union_type", content)
    for i, block in enumerate(content):
        if not isinstance(block, Mapping) or block.get("type") not in _BLOCK_TYPES:
            raise invalid(f"{field}.{i}.type", "Input should be a valid content block type",
                          "literal_error", block)
    return content


def _system_text(content: list[Mapping[str, Any]] | str) -> str:
    if isinstance(content, str):
        return "" if content.startswith(_BILLING_PREFIX) else content
    return "".join(
        b["text"] for b in content
        if b.get("type") == "text" and isinstance(b.get("text"), str) and b["text"]
        and not b["text"].startswith(_BILLING_PREFIX)
    )


def to_chat_messages(system: Any, messages: list[Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM renders for a Messages request (its conversion, text only)."""
    out: list[dict[str, Any]] = []
    if system is not None:
        text = _system_text(_blocks("system", system))
        if text:
            out.append({"role": "system", "content": text})
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise invalid(f"messages.{i}", "Input should be a valid dictionary",
                          "model_type", msg)
        role = msg.get("role")
        if role not in _ROLES:
            raise invalid(f"messages.{i}.role",
                          "Input should be 'user', 'assistant' or 'system'", "literal_error", role)
        content = _blocks(f"messages.{i}.content", msg.get("content"))
        if role == "system":
            text = _system_text(content)
            if text:
                out.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        _convert_blocks(str(role), content, out)
    return out


def _convert_blocks(
    role: str, content: list[Mapping[str, Any]], out: list[dict[str, Any]]
) -> None:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str) and block["text"]:
            texts.append(block["text"])
        elif kind == "tool_use":
            calls.append({
                "id": str(block.get("id") or ""), "type": "function",
                "function": {"name": str(block.get("name") or ""),
                             "arguments": json.dumps(block.get("input") or {})},
            })
        elif kind == "tool_result":
            result = _tool_result_text(block.get("content"))
            if role == "user":
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""),
                            "content": result})
            else:
                texts.append(f"Tool result: {result}")
    msg: dict[str, Any] = {"role": role}
    if calls:
        msg["tool_calls"] = calls
    if texts:
        msg["content"] = "".join(texts)
    if role != "user" or "content" in msg:
        out.append(msg)


def _tool_result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(p.get("text", "")) for p in content
            if isinstance(p, Mapping) and p.get("type") == "text"
        )
    return ""


# -- responses ----------------------------------------------------------------------------------

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "tool_calls": "tool_use"}


def usage(prompt: int, completion: int, cached: int, block_size: int) -> dict[str, Any]:
    """Anthropic usage as vLLM builds it with ``--enable-prompt-tokens-details``: the prompt
    split into ``cache_read_input_tokens`` (prefix-cache hits), ``cache_creation_input_tokens``
    (the prompt's full blocks this request computed, now cached) and ``input_tokens`` (the
    rest: the partial last block)."""
    created = max(0, prompt // block_size * block_size - cached)
    return {
        "input_tokens": max(0, prompt - cached - created),
        "output_tokens": completion,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": cached,
    }


def full_response(
    rid: str, model: str, text: str, finish_reason: str, u: dict[str, Any],
    tool: ForcedTool | None = None, call_id: str = "",
) -> dict[str, Any]:
    """A non-streamed Messages response (vLLM drops null fields: no ``stop_sequence``). With
    ``tool`` the content is one ``tool_use`` block whose input wraps ``text`` (vLLM leaves the
    chat message's empty text out) and ``finish_reason`` is the chat one for the call."""
    content: dict[str, Any] = {"type": "text", "text": text}
    if tool is not None:
        content = {"type": "tool_use", "id": call_id, "name": tool.name,
                   "input": json.loads(tool.arguments(text))}
    return {
        "id": rid, "type": "message", "role": "assistant", "content": [content], "model": model,
        "stop_reason": STOP_REASONS.get(finish_reason, "end_turn"), "usage": u,
    }


def event(name: str, obj: dict[str, Any]) -> bytes:
    """One SSE event as vLLM writes it: an ``event:`` line, then the ``data:`` line."""
    data = json.dumps(obj, separators=(",", ":"))
    return f"event: {name}\ndata: {data}\n\n".encode()


def message_start(rid: str, model: str, prompt: int) -> bytes:
    # vLLM builds it from the first chunk's running usage, which has no cache details yet.
    return event("message_start", {"type": "message_start", "message": {
        "id": rid, "type": "message", "role": "assistant", "content": [], "model": model,
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": 0},
    }})


def block_start(index: int) -> bytes:
    return event("content_block_start", {
        "type": "content_block_start", "content_block": {"type": "text", "text": ""},
        "index": index,
    })


def tool_block_start(index: int, call_id: str, name: str) -> bytes:
    """The start of a ``tool_use`` block, its input empty until the ``input_json_delta``s."""
    return event("content_block_start", {
        "type": "content_block_start",
        "content_block": {"type": "tool_use", "id": call_id, "name": name, "input": {}},
        "index": index,
    })


def json_delta(index: int, partial_json: str) -> bytes:
    return event("content_block_delta", {
        "type": "content_block_delta",
        "delta": {"type": "input_json_delta", "partial_json": partial_json},
        "index": index,
    })


def text_delta(index: int, text: str) -> bytes:
    return event("content_block_delta", {
        "type": "content_block_delta", "delta": {"type": "text_delta", "text": text},
        "index": index,
    })


def finish_events(finish_reason: str, u: dict[str, Any]) -> bytes:
    """The stream's tail: the block's stop, ``message_delta`` with usage, ``message_stop``."""
    return b"".join((
        event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": STOP_REASONS.get(finish_reason, "end_turn"),
                      "stop_sequence": None},
            "usage": u,
        }),
        event("message_stop", {"type": "message_stop"}),
    ))


def count_tokens_response(n: int) -> dict[str, Any]:
    return {"input_tokens": n, "context_management": {"original_input_tokens": n}}
