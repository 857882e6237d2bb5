"""Forced tool calls over real sockets, in vLLM 0.32's shapes: ``tool_choice`` "required" or a
named function on ``/v1/chat/completions`` and ``{"type": "any"}`` / ``{"type": "tool"}`` on
``/v1/messages`` answer one tool call whose arguments wrap the generated text; the engine's
token count and pacing stay those of a text reply; vLLM's validation errors; follow-ups that
echo the call and its result are accepted and hit the prefix cache."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from marsproxy.emulator.tokenizer import encode_chat, filler_text

from .sse_events import anthropic_events

MODEL = "tiny-emulated"
BLOCK = 16  # the tiny profile's block size
NATURAL = 32  # the tiny profile's natural output length
StartEmulator = Callable[..., Awaitable[TestServer]]
RUN = {"type": "function", "function": {
    "name": "run", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}
READ = {"type": "function", "function": {
    "name": "read", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
MESSAGES = [{"role": "system", "content": "You are a coding agent. " * 8},
            {"role": "user", "content": "Fix the failing test."}]
REQUIRED = {"messages": MESSAGES, "tools": [RUN], "tool_choice": "required"}  # a forced call
TOOL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{16}")  # as a real vLLM 0.32.0 makes them
FIXTURE = Path(__file__).parents[2] / "fixtures" / "vllm-0.32-chat-stream-tool-call.txt"
# vLLM's ChatMessage with tool calls (tool_calls is left out when there are none)
MESSAGE_KEYS = ["role", "content", "refusal", "annotations", "audio", "function_call",
                "tool_calls", "reasoning"]


def _sse(text: str) -> list[Any]:
    assert text.endswith("data: [DONE]\n\n")
    frames = text.split("\n\n")[:-1]
    assert all(f.startswith("data: ") for f in frames)
    return [json.loads(f[6:]) for f in frames[:-1]]


async def _chat(http: aiohttp.ClientSession, server: TestServer, body: Any) -> tuple[int, Any]:
    async with http.post(server.make_url("/v1/chat/completions"),
                         json={"model": MODEL, **body}) as resp:
        text = await resp.text()
        if resp.content_type == "text/event-stream":
            return resp.status, _sse(text)
        return resp.status, json.loads(text)


async def _messages(http: aiohttp.ClientSession, server: TestServer, body: Any) -> tuple[int, str]:
    async with http.post(server.make_url("/v1/messages"), json={"model": MODEL, **body}) as r:
        return r.status, await r.text()


# -- chat completions ----------------------------------------------------------------------------

@pytest.mark.parametrize(("ignore_eos", "finish"), [(True, "length"), (False, "tool_calls")])
async def test_required_answers_one_tool_call(
    start_emulator: StartEmulator, http: aiohttp.ClientSession, ignore_eos: bool, finish: str,
) -> None:
    server = await start_emulator()
    n = 7 if ignore_eos else NATURAL
    status, body = await _chat(http, server, {
        "messages": MESSAGES, "tools": [RUN, READ], "tool_choice": "required",
        "max_tokens": 7 if ignore_eos else 100, "ignore_eos": ignore_eos})
    assert status == 200
    choice = body["choices"][0]
    message = choice["message"]
    assert list(message) == MESSAGE_KEYS
    assert message["role"] == "assistant" and message["content"] == ""
    [call] = message["tool_calls"]
    assert TOOL_ID.fullmatch(call["id"]) and call["type"] == "function"
    assert call["function"]["name"] == "run"  # "required": the first tool
    assert json.loads(call["function"]["arguments"]) == {"command": filler_text(0, n)}
    # vLLM: "tool_calls" for "required" when the model stopped; a cut reply keeps "length"
    assert choice["finish_reason"] == finish
    assert body["usage"]["completion_tokens"] == n  # what the engine generated
    assert body["usage"]["prompt_tokens"] == len(encode_chat(MESSAGES))


async def test_named_function_keeps_the_engines_finish_reason(
    start_emulator: StartEmulator, http: aiohttp.ClientSession,
) -> None:
    server = await start_emulator()
    status, body = await _chat(http, server, {
        "messages": MESSAGES, "tools": [RUN, READ], "max_tokens": 100,
        "tool_choice": {"type": "function", "function": {"name": "read"}}})
    assert status == 200
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "read"
    # the arguments fill the tool's own (first) parameter
    assert json.loads(call["function"]["arguments"]) == {"path": filler_text(0, NATURAL)}
    assert body["choices"][0]["finish_reason"] == "stop"  # named: vLLM keeps "stop"


@pytest.mark.parametrize("named", [False, True])
async def test_streamed_tool_call(
    start_emulator: StartEmulator, http: aiohttp.ClientSession, named: bool,
) -> None:
    server = await start_emulator()
    choice: Any = {"type": "function", "function": {"name": "run"}} if named else "required"
    status, chunks = await _chat(http, server, {
        "messages": MESSAGES, "tools": [RUN], "tool_choice": choice, "max_tokens": 6,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert len(deltas) == 7  # the call named, then one delta per generated token
    assert all(list(d) == ["content", "tool_calls"] and d["content"] is None
               and len(d["tool_calls"]) == 1 for d in deltas)
    first = deltas[0]["tool_calls"][0]
    assert list(first) == ["id", "type", "index", "function"] and TOOL_ID.fullmatch(first["id"])
    assert first["type"] == "function" and first["index"] == 0
    assert first["function"] == {"name": "run"}
    later = [d["tool_calls"][0] for d in deltas[1:]]
    assert all(list(c) == ["index", "function"] and c["index"] == 0 for c in later)
    assert all(list(c["function"]) == ["arguments"] for c in later)
    args = "".join(c["function"]["arguments"] for c in later)
    assert json.loads(args) == {"command": filler_text(0, 6)}
    reasons = [c["choices"][0]["finish_reason"] for c in chunks[1:-1]]
    assert reasons == [None] * 6 + ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}


async def test_streamed_required_call_that_stops_finishes_with_tool_calls(
    start_emulator: StartEmulator, http: aiohttp.ClientSession,
) -> None:
    server = await start_emulator()
    _, chunks = await _chat(http, server, {**REQUIRED, "max_tokens": 1000, "stream": True})
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert len(chunks) == 2 + NATURAL  # the role, the call named, a delta per token


@pytest.mark.parametrize("extra", [
    {}, {"tools": [RUN]}, {"tools": [RUN], "tool_choice": "auto"},
    {"tools": [RUN], "tool_choice": "none"}, {"tool_choice": "none"}])
async def test_without_a_forced_choice_the_reply_is_text(
    start_emulator: StartEmulator, http: aiohttp.ClientSession, extra: dict[str, Any],
) -> None:
    server = await start_emulator()
    status, body = await _chat(http, server, {
        "messages": MESSAGES, "max_tokens": 5, "ignore_eos": True, **extra})
    assert status == 200
    message = body["choices"][0]["message"]
    assert message["content"] == filler_text(0, 5) and "tool_calls" not in message
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"tool_choice": "required"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tool_choice": {"type": "function", "function": {"name": "run"}}}, "tool_choice",
     "When using `tool_choice`, `tools` must be set."),
    ({"tools": [RUN], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "The tool specified in `tool_choice` does not match any of the specified"),
    ({"tools": [], "tool_choice": "required"}, "tools", "`tools` must not be an empty array."),
    ({"tools": [RUN], "tool_choice": "always"}, "tool_choice",
     "Invalid value for `tool_choice`: always!"),
    ({"tools": [RUN], "tool_choice": {"type": "function"}}, "tool_choice.function",
     "Invalid value for `function`"),
])
async def test_tool_choice_is_validated_like_vllm(
    start_emulator: StartEmulator, http: aiohttp.ClientSession,
    extra: dict[str, Any], param: str, words: str,
) -> None:
    server = await start_emulator()
    status, body = await _chat(http, server, {"messages": MESSAGES, "max_tokens": 5, **extra})
    assert status == 400
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    # A real vLLM 0.32 (2026-12, tiny model): the validator's VLLMValidationError is no
    # ValueError, so pydantic does not wrap it: 400 "BadRequestError", e.g. {"message": "When
    # using `tool_choice`, `tools` must be set. (parameter=tool_choice)", "type":
    # "BadRequestError", "param": "tool_choice", "code": 400}.
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param
    assert err["message"].startswith(words) and err["message"].endswith(f"(parameter={param})")


async def test_follow_up_echoing_the_call_hits_the_prefix_cache(
    start_emulator: StartEmulator, http: aiohttp.ClientSession,
) -> None:
    server = await start_emulator()
    _, first = await _chat(http, server, {**REQUIRED, "max_tokens": 20, "ignore_eos": True})
    [call] = first["choices"][0]["message"]["tool_calls"]
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": "1 failed, 3 passed"}]
    status, second = await _chat(http, server, {
        "messages": history, "tools": [RUN], "tool_choice": "none", "max_tokens": 3,
        "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    usage = second[-1]["usage"]
    assert usage["prompt_tokens"] == len(encode_chat(history))
    # The shared prefix (everything the first call was prompted with) is cached; the call's own
    # tokens are not (the emulated engine generated filler ids, not the call's rendering).
    prompt1 = first["usage"]["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == prompt1 // BLOCK * BLOCK > 0
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in second[1:-1])
    assert content == filler_text(0, 3)  # "none": text


# -- messages --------------------------------------------------------------------------------------

ANTH_TOOLS = [
    {"name": "bash", "description": "Run a command.",
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}},
    {"name": "read", "input_schema": {"type": "object", "properties": {"path": {}}}},
]
ANTH = {"system": "You are a careful coding agent. " * 8, "tools": ANTH_TOOLS,
        "messages": [{"role": "user", "content": "Fix the failing test."}]}


@pytest.mark.parametrize(("choice", "max_tokens", "name", "arg", "stop"), [
    ({"type": "any"}, 100, "bash", "command", "tool_use"),
    ({"type": "any"}, 5, "bash", "command", "max_tokens"),
    ({"type": "tool", "name": "read"}, 100, "read", "path", "end_turn"),
])
async def test_messages_forced_tool_use(
    start_emulator: StartEmulator, http: aiohttp.ClientSession,
    choice: dict[str, Any], max_tokens: int, name: str, arg: str, stop: str,
) -> None:
    server = await start_emulator()
    status, text = await _messages(http, server,
                                   {**ANTH, "tool_choice": choice, "max_tokens": max_tokens})
    assert status == 200
    body = json.loads(text)
    n = min(max_tokens, NATURAL)
    [block] = body["content"]
    assert list(block) == ["type", "id", "name", "input"] and block["type"] == "tool_use"
    assert TOOL_ID.fullmatch(block["id"])  # vLLM reuses the chat tool call's id
    assert block["name"] == name and block["input"] == {arg: filler_text(0, n)}
    assert body["stop_reason"] == stop  # mapped from vLLM's chat finish_reason
    assert body["usage"]["output_tokens"] == n


async def test_messages_streamed_tool_use(
    start_emulator: StartEmulator, http: aiohttp.ClientSession,
) -> None:
    server = await start_emulator()
    status, text = await _messages(http, server, {
        **ANTH, "tool_choice": {"type": "any"}, "max_tokens": 100, "stream": True})
    assert status == 200
    events = anthropic_events(text)
    names = [e for e, _ in events]
    assert names == ["message_start", "content_block_start",
                     *["content_block_delta"] * NATURAL,
                     "content_block_stop", "message_delta", "message_stop"]
    start = events[1][1]
    assert list(start) == ["type", "content_block", "index"] and start["index"] == 0
    block = start["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "bash" and block["input"] == {}
    assert TOOL_ID.fullmatch(block["id"])
    deltas = [d for e, d in events if e == "content_block_delta"]
    assert all(d["delta"]["type"] == "input_json_delta" and d["index"] == 0 for d in deltas)
    joined = "".join(d["delta"]["partial_json"] for d in deltas)
    assert json.loads(joined) == {"command": filler_text(0, NATURAL)}
    assert events[-3][1] == {"type": "content_block_stop", "index": 0}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == NATURAL


@pytest.mark.parametrize("choice", [None, {"type": "auto"}, {"type": "none"}])
async def test_messages_without_a_forced_choice_answer_text(
    start_emulator: StartEmulator, http: aiohttp.ClientSession, choice: Any,
) -> None:
    server = await start_emulator()
    body: dict[str, Any] = {**ANTH, "max_tokens": 4}
    if choice is not None:
        body["tool_choice"] = choice
    status, text = await _messages(http, server, body)
    assert status == 200
    assert json.loads(text)["content"] == [{"type": "text", "text": filler_text(0, 4)}]


@pytest.mark.parametrize(("choice", "param"), [
    ({"type": "sometimes"}, "body.tool_choice.type"),
    ({"type": "tool"}, "body.tool_choice"),
])
async def test_messages_tool_choice_validation(
    start_emulator: StartEmulator, http: aiohttp.ClientSession, choice: Any, param: str,
) -> None:
    server = await start_emulator()
    status, text = await _messages(http, server, {**ANTH, "tool_choice": choice,
                                                   "max_tokens": 4})
    assert status == 400
    err = json.loads(text)["error"]
    assert err["type"] == "Bad Request" and err["param"] == param and err["code"] == 400


async def test_messages_follow_up_with_tool_result_hits_the_prefix_cache(
    start_emulator: StartEmulator, http: aiohttp.ClientSession,
) -> None:
    server = await start_emulator()
    _, text = await _messages(http, server, {**ANTH, "tool_choice": {"type": "any"},
                                             "max_tokens": 20})
    first = json.loads(text)
    block = first["content"][0]
    follow = {**ANTH, "max_tokens": 3, "messages": [
        *ANTH["messages"],
        {"role": "assistant", "content": [block]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block["id"], "content": "1 failed"}]}]}
    status, text = await _messages(http, server, follow)
    assert status == 200
    body = json.loads(text)
    assert body["content"] == [{"type": "text", "text": filler_text(0, 3)}]
    u1 = first["usage"]
    prompt1 = u1["input_tokens"] + u1["cache_creation_input_tokens"]
    assert body["usage"]["cache_read_input_tokens"] == prompt1 // BLOCK * BLOCK > 0


def _shape(obj: Any) -> Any:
    """The keys of a JSON value, nested (values left out)."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shape(v) for v in obj[:1]]
    return None


async def test_streamed_call_is_keyed_as_a_real_vllms(
    start_emulator: StartEmulator, http: aiohttp.ClientSession,
) -> None:
    # The real stream (tests/fixtures/README.md): the role chunk, the call named, then one
    # arguments delta per token, cut at max_tokens.
    real = [c["choices"][0] for c in _sse(FIXTURE.read_text())[:-1]]
    server = await start_emulator()
    _, chunks = await _chat(http, server, {
        **REQUIRED, "max_tokens": 6,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    mine = [c["choices"][0] for c in chunks[:-1]]
    for pick in (1, 2):  # the delta that names the call; one that appends arguments
        assert _shape(mine[pick]["delta"]) == _shape(real[pick]["delta"])
    assert TOOL_ID.fullmatch(real[1]["delta"]["tool_calls"][0]["id"])
    assert (mine[-1]["finish_reason"], real[-1]["finish_reason"]) == ("length", "length")
