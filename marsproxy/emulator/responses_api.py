"""The Responses API (``/v1/responses``) as vLLM 0.32 serves it: request reading, the prompt
it renders, response objects and stream events (no I/O).

vLLM turns a request into chat messages (``instructions`` as the system message; with
``previous_response_id`` the stored response's input messages without their system message and
its output as assistant messages; then ``input``: a string is one user message, items become
messages, ``function_call`` items the assistant's ``tool_calls``, ``function_call_output``
items ``tool`` messages) and renders them through the chat template, so a Responses history hits
the prefix cache as the same chat history does. Only with ``VLLM_ENABLE_RESPONSES_API_STORE=1``
does it keep responses (``store``, default true, is ignored otherwise): a ``previous_response_id``
it does not hold, another server's included, is a 404.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from marsproxy.emulator.anthropic_api import invalid
from marsproxy.emulator.openai_api import (
    ApiError,
    created_cache_tokens,
    model_not_found,
    validation_error,
)
from marsproxy.emulator.openai_request import check_prompt_length
from marsproxy.emulator.responses_tools import echoed_choice, forced_tool
from marsproxy.emulator.tokenizer import PromptError, encode_chat
from marsproxy.emulator.tool_calls import ForcedTool

Message = dict[str, Any]
_TOOL_FIELDS = ("name", "parameters", "strict", "type", "allowed_callers", "async",
                "defer_loading", "description", "output_schema")
STORE_CAP = 10_000
"""Responses a store keeps, the oldest dropped first (vLLM's own store never forgets: a
long benchmark against the emulator should not grow without bound)."""


@dataclass(frozen=True)
class Stored:
    messages: list[Message]  # the request's rendered input, system message included
    reply: Message | None  # the assistant message its output renders to (``None``: no output)
    response: dict[str, Any]  # as it was answered: ``GET /v1/responses/{id}`` returns it


@dataclass
class ResponseStore:
    """The server's stored responses (``VLLM_ENABLE_RESPONSES_API_STORE=1``)."""

    enabled: bool = False
    _kept: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def get(self, rid: str) -> Stored | None:
        return self._kept.get(rid)

    def put(self, rid: str, stored: Stored) -> None:
        self._kept[rid] = stored
        while len(self._kept) > STORE_CAP:
            self._kept.popitem(last=False)


@dataclass(frozen=True)
class ResponsesRequest:
    body: Mapping[str, Any]
    messages: list[Message]
    prompt_token_ids: list[int]
    max_tokens: int
    stream: bool
    store: bool  # kept after it is served (the store on and ``store`` not false)
    background: bool  # answered ``queued`` at once, generated after (needs the store)
    tool: ForcedTool | None  # the reply is this function call instead of a message


def not_found(rid: str) -> ApiError:
    return ApiError(404, f"Response with id '{rid}' not found.", "invalid_request_error",
                    "response_id")


def cannot_cancel() -> ApiError:
    """vLLM's answer to cancelling a response that is not queued or in progress."""
    return ApiError(400, "Cannot cancel a synchronous response.", "invalid_request_error",
                    "response_id")


def parse(body: Any, served_model: str, max_model_len: int,
          store: ResponseStore) -> ResponsesRequest:
    """Validate a request and render its prompt, in vLLM's order: the body, ``background``
    with ``store`` false (the request model's validator), the fields, the model, ``background``
    without the server's store, the previous response, the output budget, the prompt's length;
    raises :class:`ApiError`."""
    if not isinstance(body, Mapping):
        raise invalid("", "Input should be a valid dictionary", "model_attributes_type", body)
    if body.get("background") and not body.get("store", True):
        raise validation_error("background can only be used when `store` is true", "background")
    tool = forced_tool(body)
    if "input" not in body:
        raise invalid("input", "Field required", "missing", body)
    inp, instructions = body["input"], body.get("instructions")
    if not isinstance(inp, str | list):
        raise invalid("input", "Input should be a valid string", "string_type", inp)
    model = body.get("model")
    if model is not None and model != served_model:
        raise model_not_found(str(model), served_model)
    if body.get("background") is True and body.get("store") is not False and not store.enabled:
        raise ApiError(400, "This vLLM engine does not support `store=True` and therefore does"
                       " not support the background mode. To enable these features, set the"
                       " environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching"
                       " the vLLM server.", "invalid_request_error", "background")
    prev_id = body.get("previous_response_id")
    prev = None if prev_id is None else store.get(str(prev_id))
    if prev_id is not None and prev is None:
        raise not_found(str(prev_id))
    messages = input_messages(instructions if isinstance(instructions, str) else None, inp, prev)
    try:
        ids = encode_chat(messages)
    except PromptError as exc:
        raise invalid("input", str(exc), "value_error", inp) from exc
    asked = body.get("max_output_tokens")
    if isinstance(asked, int) and asked > max_model_len:
        raise validation_error(f"max_output_tokens={asked} cannot be greater than max_model_len="
                               f"{max_model_len}. Please request fewer output tokens.",
                               "max_output_tokens", asked)
    check_prompt_length(len(ids), max_model_len, text=True)
    room = max_model_len - len(ids)
    max_tokens = room if not isinstance(asked, int) else min(asked, room)
    if max_tokens < 1:
        raise validation_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens",
                               max_tokens)
    kept = store.enabled and body.get("store") is not False
    return ResponsesRequest(body, messages, ids, max_tokens, body.get("stream") is True, kept,
                            kept and bool(body.get("background")), tool)


def input_messages(instructions: str | None, inp: str | list[Any],
                   prev: Stored | None) -> list[Message]:
    """The chat messages vLLM renders for a request."""
    messages: list[Message] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if prev is not None:  # instructions do not carry over from the earlier request
        messages.extend(dict(m) for m in prev.messages if m.get("role") != "system")
        if prev.reply is not None:
            messages.append(dict(prev.reply))
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
        return messages
    for item in inp:
        _add_item(messages, item)
    return messages


def _add_item(messages: list[Message], item: Any) -> None:
    if not isinstance(item, Mapping):
        raise invalid("input", "Input should be a valid dictionary", "dict_type", item)
    kind, last = item.get("type"), messages[-1] if messages else None
    open_turn = last if last is not None and last.get("role") == "assistant" else None
    if kind == "function_call":  # joins the assistant turn before it, as vLLM merges them
        call = {"id": item.get("call_id"), "type": "function", "function": {
            "name": item.get("name"), "arguments": item.get("arguments")}}
        if open_turn is not None:
            open_turn.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        messages.append({"role": "tool", "content": item.get("output"),
                         "tool_call_id": item.get("call_id")})
    elif kind == "reasoning":
        pass  # the chat template renders no reasoning of earlier turns
    elif "role" in item and kind in (None, "message"):
        text = _text(item.get("content"))
        if item["role"] == "assistant" and open_turn is not None and "content" not in open_turn:
            open_turn["content"] = text
        else:
            messages.append({"role": item["role"], "content": text})
    else:
        raise invalid("input", f"Unsupported input item type: {kind}", "value_error", item)


def _text(content: Any) -> str:
    """A message item's content as text: a string, or its parts' text (``input_text``,
    ``output_text``) joined; other parts (images, files) have no text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content
                       if isinstance(p, Mapping) and p.get("type") in (
                           "input_text", "output_text", "text"))
    raise invalid("input", "Input should be a valid string", "string_type", content)


# -- responses ----------------------------------------------------------------------------------

def usage(prompt: int, completion: int, cached: int, block_size: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": created_cache_tokens(prompt, cached, block_size),
            "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": 0, "tool_output_tokens": 0,
            "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
        "total_tokens": prompt + completion,
    }


def text_part(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(mid: str, text: str | None) -> dict[str, Any]:
    """The reply's message item; ``None``: not started (the stream's ``in_progress`` item)."""
    return {"id": mid, "content": [] if text is None else [text_part(text)],
            "role": "assistant", "status": "in_progress" if text is None else "completed",
            "type": "message", "phase": None}


def response(rid: str, created: int, model: str, req: ResponsesRequest,
             output: list[dict[str, Any]], status: str,
             u: dict[str, Any] | None) -> dict[str, Any]:
    """The response object, fields in vLLM's order; the request's settings echoed."""
    b = req.body
    tools = [_tool(t) for t in b.get("tools") or ()]
    return {
        "id": rid, "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": b.get("instructions"), "metadata": b.get("metadata"), "model": model,
        "object": "response", "output": output,
        "parallel_tool_calls": b.get("parallel_tool_calls", True),
        "temperature": float(b.get("temperature", 1.0)),
        "tool_choice": echoed_choice(b), "tools": tools,
        "top_p": float(b.get("top_p", 1.0)), "background": bool(b.get("background", False)),
        "max_output_tokens": req.max_tokens, "max_tool_calls": b.get("max_tool_calls"),
        "previous_response_id": b.get("previous_response_id"), "prompt": b.get("prompt"),
        "reasoning": b.get("reasoning"), "service_tier": b.get("service_tier", "auto"),
        "status": status, "text": b.get("text"), "top_logprobs": b.get("top_logprobs"),
        "truncation": b.get("truncation", "disabled"), "usage": u, "user": b.get("user"),
        "presence_penalty": float(b.get("presence_penalty", 0.0)),
        "frequency_penalty": float(b.get("frequency_penalty", 0.0)),
        "kv_transfer_params": None, "ec_transfer_params": None,
        "input_messages": None, "output_messages": None,
    }


def _tool(tool: Any) -> Any:
    """A function tool as vLLM echoes it: every field of its model, unset ones null."""
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        return tool
    return {k: tool.get(k) for k in _TOOL_FIELDS} | {
        k: v for k, v in tool.items() if k not in _TOOL_FIELDS}


class Events:
    """A stream's events, each with its ``sequence_number``, as vLLM writes them."""

    def __init__(self) -> None:
        self.seq = 0

    def event(self, kind: str, tail: Mapping[str, Any] | None = None, **fields: Any) -> bytes:
        # vLLM's event models list their fields in alphabetical order (``tail``: after them).
        obj = dict(sorted({**fields, "sequence_number": self.seq, "type": kind}.items()))
        obj.update(tail or {})
        self.seq += 1
        data = json.dumps(obj, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def opening(self, resp: dict[str, Any], mid: str) -> list[bytes]:
        return [self.event("response.created", response=resp),
                self.event("response.in_progress", response=resp),
                self.event("response.output_item.added", item=message_item(mid, None),
                           output_index=0),
                self.event("response.content_part.added", content_index=0, item_id=mid,
                           output_index=0, part=text_part("", [])),
                ]

    def delta(self, mid: str, text: str) -> bytes:
        return self.event("response.output_text.delta", content_index=0, delta=text,
                          item_id=mid, logprobs=[], output_index=0)

    def closing(self, resp: dict[str, Any], mid: str, text: str) -> list[bytes]:
        return [self.event("response.output_text.done", content_index=0, item_id=mid,
                           logprobs=[], output_index=0, text=text),
                self.event("response.content_part.done", content_index=0, item_id=mid,
                           output_index=0, part=text_part(text)),
                self.event("response.output_item.done", item=message_item(mid, text),
                           output_index=0),
                self.event("response.completed", response=resp),
                ]

    def call_opening(self, resp: dict[str, Any], item: dict[str, Any]) -> list[bytes]:
        """A forced function call's stream: its item opened with no arguments yet."""
        return [self.event("response.created", response=resp),
                self.event("response.in_progress", response=resp),
                self.event("response.output_item.added", item=item, output_index=0)]

    def call_delta(self, item_id: str, piece: str) -> bytes:
        return self.event("response.function_call_arguments.delta", delta=piece,
                          item_id=item_id, output_index=0)

    def call_closing(self, resp: dict[str, Any], item: dict[str, Any]) -> list[bytes]:
        return [self.event("response.function_call_arguments.done", {"name": item["name"]},
                           arguments=item["arguments"], item_id=item["id"], output_index=0),
                self.event("response.output_item.done", item=item, output_index=0),
                self.event("response.completed", response=resp)]
