"""SSE splitting and usage-chunk handling, on real vLLM bytes where captured fixtures exist."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marsproxy.core.canon import chat_reply_unit
from marsproxy.core.identity import Route
from marsproxy.gateway.http.sse import (
    UNREADABLE,
    SSEFilter,
    StreamTap,
    Usage,
    event_data,
    read_body,
)
from marsproxy.gateway.http.sse_split import SSESplitter

FIXTURES = Path(__file__).parents[2] / "fixtures"

# vLLM 0.32 framing (compact JSON, `data: ...\n\n`), with stream_options.include_usage.
SAMPLE_CHAT = (
    b"".join(
        b"data: " + json.dumps(o, separators=(",", ":")).encode() + b"\n\n"
        for o in [
            {
                "id": "c1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            },
            {
                "id": "c1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": "Hello \u00e9\u4e16"},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            },
            {
                "id": "c1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": " world"},
                        "logprobs": None,
                        "finish_reason": "stop",
                        "stop_reason": None,
                    }
                ],
            },
            {
                "id": "c1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "choices": [],
                "usage": {
                    "prompt_tokens": 17,
                    "total_tokens": 20,
                    "completion_tokens": 3,
                    "prompt_tokens_details": {"cached_tokens": 16},
                },
            },
        ]
    )
    + b"data: [DONE]\n\n"
)


def _streams() -> list[tuple[str, Route, bytes]]:
    """The inline sample plus every captured vLLM stream with a usage chunk."""
    found: list[tuple[str, Route, bytes]] = [("sample", "chat", SAMPLE_CHAT)]
    for path in sorted(FIXTURES.glob("*stream*.txt")):
        data = path.read_bytes()
        if b'"choices":[]' in data and b'"usage"' in data:
            found.append((path.name, "chat" if "chat" in path.name else "completions", data))
    return found


STREAMS = _streams()
IDS = [n for n, _, _ in STREAMS]


def _relay(
    data: bytes, cuts: list[int], *, strip: bool, capture: bool = False, route: Route = "chat"
) -> tuple[list[bytes], StreamTap]:
    """Feed ``data`` split at ``cuts`` through the filter (splitter + tap), as the relay does."""
    tap = StreamTap(route, strip_usage_chunk=strip, capture=capture)
    sse = SSEFilter(tap)
    out: list[bytes] = []
    prev = 0
    for cut in [*sorted(set(cuts)), len(data)]:
        out.append(sse.feed(data[prev:cut]))
        prev = cut
    out.append(sse.flush())
    return [o for o in out if o], tap


def _usage_of(data: bytes) -> dict[str, int]:
    for line in data.split(b"\n\n"):
        if line.startswith(b"data: {") and b'"choices":[]' in line:
            return json.loads(line[6:])["usage"]  # type: ignore[no-any-return]
    raise AssertionError("stream has no usage chunk")


@pytest.mark.parametrize(("name", "route", "data"), STREAMS, ids=IDS)
@settings(max_examples=150, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12))
def test_injected_usage_chunk_is_dropped_at_any_split(
    name: str, route: Route, data: bytes, cuts: list[int]
) -> None:
    cuts = [c % (len(data) + 1) for c in cuts]
    out, tap = _relay(data, cuts, strip=True, route=route)
    joined = b"".join(out)
    usage_line = next(e for e in SSESplitter().feed(data) if b'"choices":[]' in e)
    assert joined == data.replace(usage_line, b"")  # byte-exact otherwise
    assert joined.endswith(b"data: [DONE]\n\n")
    assert tap.usage is not None
    u = _usage_of(data)
    assert (tap.usage.prompt_tokens, tap.usage.completion_tokens) == (
        u["prompt_tokens"],
        u["completion_tokens"],
    )


@pytest.mark.parametrize(("name", "route", "data"), STREAMS, ids=IDS)
@settings(max_examples=50, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12))
def test_usage_chunk_the_client_asked_for_passes_through(
    name: str, route: Route, data: bytes, cuts: list[int]
) -> None:
    out, tap = _relay(data, [c % (len(data) + 1) for c in cuts], strip=False, route=route)
    assert b"".join(out) == data
    assert tap.usage is not None and tap.usage.prompt_tokens == _usage_of(data)["prompt_tokens"]


def test_events_are_released_only_at_boundaries() -> None:
    s = SSESplitter()
    assert s.feed(b'data: {"a"') == []
    assert s.feed(b":1}\n") == []
    assert s.feed(b"\ndata: [DO") == [b'data: {"a":1}\n\n']
    assert s.feed(b"NE]\r\n\r\n") == [b"data: [DONE]\r\n\r\n"]
    assert s.flush() == b""


def test_whole_plain_events_pass_as_the_same_bytes() -> None:
    tap = StreamTap("chat", strip_usage_chunk=True, capture=False)
    sse = SSEFilter(tap)
    events = SSESplitter().feed(SAMPLE_CHAT)
    content = events[1] + events[2]
    assert b'"usage"' not in content
    assert sse.feed(content) is content  # no split, no copy
    # A partial event switches to the splitter until a boundary is reached again.
    assert sse.feed(events[1][:10]) == b""
    assert sse.feed(events[1][10:]) == events[1]
    usage = next(e for e in events if b'"choices":[]' in e)
    assert sse.feed(usage) == b""  # the injected usage chunk is still dropped
    assert tap.usage is not None
    err = b'data: {"error":{"message":"boom"}}\n\n'
    assert sse.feed(err) == err and tap.saw_error
    assert sse.flush() == b""


def test_event_data_joins_multiline_and_skips_event_lines() -> None:
    assert event_data(b"event: x\ndata: a\ndata: b\n\n") == b"a\nb"


def test_reply_capture_from_stream_matches_the_echoed_message() -> None:
    _, tap = _relay(SAMPLE_CHAT, [5, 50, 300], strip=True, capture=True)
    reply = tap.reply()
    assert reply is not None
    assert reply.units == (chat_reply_unit("Hello \u00e9\u4e16 world", []),)


def test_reply_capture_of_streamed_tool_calls() -> None:
    chunks = [
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "c",
                                "type": "function",
                                "function": {"name": "bash", "arguments": ""},
                            }
                        ]
                    },
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"cmd": '}}]},
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"ls"}'}}]},
                }
            ]
        },
    ]
    data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    _, tap = _relay(data, [], strip=False, capture=True)
    assert tap.reply() is not None
    assert tap.reply().units == (chat_reply_unit("", [("bash", '{"cmd":"ls"}')]),)  # type: ignore[union-attr]


def test_no_parse_without_usage_or_capture() -> None:
    # A chunk that is not valid JSON but has no "usage": the tap must not even look.
    tap = StreamTap("chat", strip_usage_chunk=True, capture=False)
    assert tap.keep(b"data: {not json\n\n")


def test_anthropic_and_responses_usage() -> None:
    tap = StreamTap("messages", strip_usage_chunk=False, capture=True)
    events = [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {"usage": {"input_tokens": 9, "output_tokens": 1}},
            },
        ),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "hi"},
            },
        ),
        ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 4}}),
    ]
    for name, obj in events:
        assert tap.keep(f"event: {name}\ndata: {json.dumps(obj)}\n\n".encode())
    assert tap.usage is not None and (tap.usage.prompt_tokens, tap.usage.completion_tokens) == (
        9,
        4,
    )
    rtap = StreamTap("responses", strip_usage_chunk=False, capture=False)
    done = {
        "type": "response.completed",
        "response": {"usage": {"input_tokens": 3, "output_tokens": 2}, "output": []},
    }
    rtap.keep(f"event: response.completed\ndata: {json.dumps(done)}\n\n".encode())
    assert rtap.usage is not None and rtap.usage.completion_tokens == 2


def test_non_streaming_body_usage_and_reply() -> None:
    body = json.dumps(
        {
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1},
        }
    ).encode()
    usage, reply, _, _ = read_body("chat", body, capture=True)
    assert usage is not None and usage.prompt_tokens == 5
    assert reply is not None and reply.units == (chat_reply_unit("ok", []),)
    for odd in (b"not json", b"[1, 2]"):  # the caller logs what it could not read
        with pytest.raises(UNREADABLE):
            read_body("chat", odd, capture=False)


def _reference_split(data: bytes) -> tuple[list[bytes], bytes]:
    """The SSE spec's rule spelled out: lines end in CR LF, LF or CR; a line terminator right
    after another one (a blank line) ends the event. A CR last in the data may be the start
    of a CR LF: no boundary yet."""
    events, start, line, i = [], 0, 0, 0
    while i < len(data):
        if data[i] not in b"\r\n":
            i += 1
            continue
        if data[i:] == b"\r":
            break
        end = i + 2 if data[i:i + 2] == b"\r\n" else i + 1
        if i == line and line != start:  # the event's first terminator ends a line, not it
            events.append(data[start:end])
            start = end
        line = i = end
    return events, data[start:]


def test_bare_cr_line_ends_split_events() -> None:
    """The SSE spec allows a lone CR as a line end: such a stream is cut into its events
    (a CR last in a read waits for the next byte: it may start a CR LF)."""
    s = SSESplitter()
    assert s.feed(b"data: a\r\rdata: b\r\r") == [b"data: a\r\r"]
    assert s.feed(b"data: c\n\r\n") == [b"data: b\r\r", b"data: c\n\r\n"]
    assert s.feed(b"data: [DONE]\r\r") == []
    assert s.flush() == b"data: [DONE]\r\r"
    tap = StreamTap("chat", strip_usage_chunk=True, capture=False)
    flt = SSEFilter(tap)
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\r\r'
    out = flt.feed(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\r\r' + usage)
    out += flt.feed(b"data: [DONE]\r\r") + flt.flush()
    assert tap.usage == Usage(3, 2, 0) and b"usage" not in out and out.endswith(b"[DONE]\r\r")


@settings(max_examples=300, deadline=None)
@given(
    data=st.lists(st.sampled_from([b"a", b"\n", b"\r", b":", b"\r\n", b"\n\n"]), max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=6),
)
def test_splitter_matches_the_rule_on_mixed_line_endings(
    data: list[bytes], cuts: list[int]
) -> None:
    raw = b"".join(data)
    s, out, prev = SSESplitter(), [], 0
    for cut in [*sorted({c % (len(raw) + 1) for c in cuts}), len(raw)]:
        out.extend(s.feed(raw[prev:cut]))
        prev = cut
    events, rest = _reference_split(raw)
    assert (out, s.flush()) == (events, rest)


def test_a_responses_reply_id_is_read_whole_and_streamed_and_only_there() -> None:
    resp = {"id": "resp_9", "object": "response", "status": "completed", "output": [],
            "usage": {"input_tokens": 3, "output_tokens": 2}}
    assert read_body("responses", json.dumps(resp).encode(), capture=False, kinds=False)[3] \
        == "resp_9"
    assert read_body("chat", json.dumps(resp).encode(), capture=True)[3] is None
    assert read_body("responses", json.dumps({**resp, "id": 9}).encode(), capture=False)[3] \
        is None
    tap = StreamTap("responses", strip_usage_chunk=False, capture=False, kinds=False)
    done = {"type": "response.completed", "response": resp}
    chunk = f"event: response.completed\ndata: {json.dumps(done)}\n\n".encode()
    assert not tap.passes(chunk) and tap.keep(chunk) and tap.response_id == "resp_9"


def test_a_background_streams_id_is_read_from_its_first_event_only_when_wanted() -> None:
    created = {"type": "response.created", "response": {"id": "resp_1", "status": "queued"}}
    event = f"event: response.created\ndata: {json.dumps(created)}\n\n".encode()
    for wanted in (True, False):
        tap = StreamTap("responses", strip_usage_chunk=False, capture=False, created=wanted)
        assert tap.passes(event) is not wanted  # else forwarded without a look
        assert tap.keep(event)
        assert tap.response_id == ("resp_1" if wanted else None)
    # Read once: the next events pass unread again.
    assert tap.passes(event)
    wanted_tap = StreamTap("responses", strip_usage_chunk=False, capture=False, created=True)
    wanted_tap.keep(event)
    assert wanted_tap.passes(event)
