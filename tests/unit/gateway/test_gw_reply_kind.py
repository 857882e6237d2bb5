"""A reply's kind (called a tool, answered, neither) read from whole and streamed replies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from marsproxy.core.answers import ReplyKind
from marsproxy.gateway.http.reply_kind import offers_tools
from marsproxy.gateway.http.sse import SSEFilter, StreamTap, read_body

FIXTURES = Path(__file__).parents[2] / "fixtures"
USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
CALL = {"id": "chatcmpl-tool-1", "type": "function",
        "function": {"name": "run", "arguments": "{\"command\": \"ls\"}"}}


def _chat(message: dict[str, Any], finish: str | None) -> bytes:
    return json.dumps({"object": "chat.completion", "usage": USAGE, "choices": [
        {"index": 0, "message": message, "finish_reason": finish}]}).encode()


@pytest.mark.parametrize(("body", "kind"), [
    # vLLM answers a forced tool call (tool_choice "required" or named) with finish "stop".
    (_chat({"role": "assistant", "content": "", "tool_calls": [CALL]}, "stop"),
     ReplyKind.TOOL_CALL),
    (_chat({"role": "assistant", "content": None, "tool_calls": [CALL]}, "tool_calls"),
     ReplyKind.TOOL_CALL),
    (_chat({"role": "assistant", "content": "done", "tool_calls": []}, "stop"), ReplyKind.ANSWER),
    # Cut at max_tokens without a tool call: agent loops end there too.
    (_chat({"role": "assistant", "content": "cut"}, "length"), ReplyKind.ANSWER),
    (_chat({"role": "assistant", "content": "?"}, None), None),  # no end seen
])
def test_chat_body(body: bytes, kind: ReplyKind | None) -> None:
    for capture in (False, True):
        assert read_body("chat", body, capture=capture)[2] is kind


def test_messages_and_responses_bodies() -> None:
    def msg(content: list[dict[str, Any]], stop: str) -> bytes:
        return json.dumps({"type": "message", "content": content, "stop_reason": stop,
                           "usage": {"input_tokens": 5, "output_tokens": 3}}).encode()
    tool = {"type": "tool_use", "id": "toolu_1", "name": "run", "input": {"command": "ls"}}
    text = {"type": "text", "text": "done"}
    assert read_body("messages", msg([text, tool], "tool_use"),
                                capture=False)[2] is ReplyKind.TOOL_CALL
    assert read_body("messages", msg([text], "end_turn"),
                                capture=False)[2] is ReplyKind.ANSWER
    assert read_body("messages", msg([text], "max_tokens"),
                                capture=False)[2] is ReplyKind.ANSWER
    # The real vLLM's reply, cut at max_tokens.
    real = (FIXTURES / "vllm-0.32-messages.json").read_bytes()
    assert read_body("messages", real, capture=False)[2] is ReplyKind.ANSWER

    def resp(output: list[dict[str, Any]], status: str) -> bytes:
        return json.dumps({"object": "response", "status": status, "output": output,
                           "usage": {"input_tokens": 5, "output_tokens": 3}}).encode()
    call = {"type": "function_call", "name": "run", "arguments": "{}", "call_id": "c1"}
    said = {"type": "message", "content": [{"type": "output_text", "text": "done"}]}
    assert read_body("responses", resp([call], "completed"),
                                capture=False)[2] is ReplyKind.TOOL_CALL
    assert read_body("responses", resp([said], "completed"),
                                capture=False)[2] is ReplyKind.ANSWER
    assert read_body("responses", resp([said], "incomplete"),
                                capture=False)[2] is ReplyKind.ANSWER
    # Not ended: a background response still queued or generating; failed; cancelled.
    for status in ("queued", "in_progress", "failed", "cancelled"):
        assert read_body("responses", resp([], status), capture=False)[2] is None


def _sse(objs: list[dict[str, Any]], spaced: bool = False) -> bytes:
    seps = (", ", ": ") if spaced else (",", ":")
    return b"".join(b"data: " + json.dumps(o, separators=seps).encode() + b"\n\n"
                    for o in objs) + b"data: [DONE]\n\n"


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


TOOL_STREAM = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"tool_calls": [{"index": 0, "id": "chatcmpl-tool-1", "type": "function",
                            "function": {"name": "run", "arguments": ""}}]}),
    *[_chunk({"tool_calls": [{"index": 0, "function": {"arguments": part}}]})
      for part in ("{\"command\"", ": \"ls\"}")],
    _chunk({}, "stop"),
    {"object": "chat.completion.chunk", "choices": [], "usage": USAGE},
]
ANSWER_STREAM = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "done"}),
                 _chunk({"content": "."}, "stop"),
                 {"object": "chat.completion.chunk", "choices": [], "usage": USAGE}]


def _tap(raw: bytes, size: int, capture: bool, kinds: bool = True) -> tuple[StreamTap, bytes]:
    tap = StreamTap("chat", strip_usage_chunk=False, capture=capture, kinds=kinds)
    flt = SSEFilter(tap)
    out = b"".join(flt.feed(raw[i:i + size]) for i in range(0, len(raw), size)) + flt.flush()
    return tap, out


@pytest.mark.parametrize("spaced", [False, True])
@pytest.mark.parametrize("capture", [False, True])
def test_chat_streams_any_chunking(spaced: bool, capture: bool) -> None:
    for events, kind in ((TOOL_STREAM, ReplyKind.TOOL_CALL), (ANSWER_STREAM, ReplyKind.ANSWER)):
        raw = _sse(events, spaced)
        for size in (1, 9, 80, len(raw)):
            tap, out = _tap(raw, size, capture)
            assert out == raw  # looked at, never changed
            assert tap.kind is kind, (events is TOOL_STREAM, size)
    # The real vLLM's stream, cut at max_tokens (finish "length"): an answer all the same.
    real = (FIXTURES / "vllm-0.32-chat-stream.txt").read_bytes()
    assert _tap(real, 64, capture)[0].kind is ReplyKind.ANSWER
    cut = _sse(ANSWER_STREAM[:2])  # it ended before its finish reason: unknown
    assert _tap(cut, 16, capture)[0].kind is None
    # A real forced tool call, cut at max_tokens: a tool call all the same.
    real = (FIXTURES / "vllm-0.32-chat-stream-tool-call.txt").read_bytes()
    tap, out = _tap(real, 64, capture)
    assert out == real and tap.kind is ReplyKind.TOOL_CALL


def test_messages_stream() -> None:
    def ev(name: str, obj: dict[str, Any]) -> bytes:
        return f"event: {name}\ndata: {json.dumps(obj)}\n\n".encode()
    start = ev("message_start", {"type": "message_start", "message": {
        "usage": {"input_tokens": 5, "output_tokens": 0}}})
    tool = ev("content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "tool_use", "id": "toolu_1",
                                                        "name": "run", "input": {}}})
    args = ev("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
        "type": "input_json_delta", "partial_json": "{\"command\": \"ls\"}"}})

    def end(stop: str) -> bytes:
        return ev("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop},
                                    "usage": {"output_tokens": 3}})
    text = ev("content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "text", "text": ""}})
    for raw, kind in ((start + tool + args + end("tool_use"), ReplyKind.TOOL_CALL),
                      (start + text + end("end_turn"), ReplyKind.ANSWER),
                      (start + text + end("max_tokens"), ReplyKind.ANSWER),
                      (start + text, None),
                      ((FIXTURES / "vllm-0.32-messages-stream.txt").read_bytes(),
                       ReplyKind.ANSWER)):
        for capture in (False, True):
            tap = StreamTap("messages", strip_usage_chunk=False, capture=capture)
            flt = SSEFilter(tap)
            assert b"".join(flt.feed(raw[i:i + 50]) for i in range(0, len(raw), 50)) \
                + flt.flush() == raw
            assert tap.kind is kind


def test_only_a_request_that_offered_tools_is_answered() -> None:
    # A harness's side request (a title, a summary) carries no tools: its text says nothing.
    assert offers_tools({"tools": [CALL]}) and offers_tools({"functions": [{"name": "f"}]})
    assert not offers_tools({"tools": []}) and not offers_tools({"messages": []})
    # The reply to one that offered none is not read for its kind, streamed or whole; its
    # bytes and usage pass as ever.
    for capture in (False, True):
        for events in (ANSWER_STREAM, TOOL_STREAM):
            raw = _sse(events)
            tap, out = _tap(raw, 9, capture, kinds=False)
            assert out == raw and tap.kind is None and tap.usage is not None
        body = json.dumps({"choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": "a title"}}], "usage": USAGE}).encode()
        usage, _, kind, _ = read_body("chat", body, capture=capture, kinds=False)
        assert kind is None and usage is not None and usage.prompt_tokens == 5
        assert read_body("chat", body, capture=capture)[2] is ReplyKind.ANSWER
    assert read_body("chat", b'{"choices": []}', capture=False, kinds=False) == (
        None, None, None, None)
