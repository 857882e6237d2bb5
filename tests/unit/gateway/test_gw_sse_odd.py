"""A worker's stream that the tap cannot read, or an event of several MiB: the bytes go to the
client as the worker sent them, the tap reads what it can, and nothing raises."""

import json
import time
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marsproxy.core.answers import ReplyKind
from marsproxy.core.identity import Route
from marsproxy.gateway.http import sse_split
from marsproxy.gateway.http.sse import SSEFilter, StreamTap, read_body
from marsproxy.gateway.http.sse_split import SSESplitter

DEEP = b"[" * 100_000 + b"]" * 100_000  # nested deeper than the interpreter's stack
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\n'
ODD: list[tuple[Route, bytes]] = [
    ("chat", b'data: {"choices":[],"usage":{},"x":' + DEEP + b"}\n\n"),
    ("chat", b'data: {"choices":[{"index":0,"delta":"x","finish_reason":"stop"}]}\n\n'),
    ("chat", b'data: {"choices":[{"index":0,"delta":{"tool_calls":[7]}}]}\n\n'),
    ("chat", b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":null}]}}]}\n\n'),
    ("messages", b'data: {"type":"message_start","message":"m","usage":{}}\n\n'),
    ("messages", b'data: {"type":"message_delta","delta":[1],"usage":{"output_tokens":3}}\n\n'),
    ("messages", b'data: {"type":"content_block_delta","index":"a","delta":{}}\n\n'),
    ("messages", b'data: {"type":"error","x":' + DEEP + b"}\n\n"),
    ("responses", b'data: {"type":"response.completed","response":' + DEEP + b"}\n\n"),
]


@pytest.mark.parametrize(("route", "event"), ODD)
@pytest.mark.parametrize("capture", [False, True])
def test_an_event_the_tap_cannot_read_is_forwarded_as_it_came(
    route: Route, event: bytes, capture: bool
) -> None:
    tap = StreamTap(route, strip_usage_chunk=route == "chat", capture=capture)
    sse = SSEFilter(tap)
    assert sse.feed(event) == event
    assert sse.feed(event[:7]) + sse.feed(event[7:]) == event
    if route == "chat":  # the stream goes on being read: the usage after it still counts
        assert sse.feed(USAGE) == b"" and tap.usage is not None
        assert tap.usage.completion_tokens == 3
    _ = (tap.reply(), tap.kind)  # neither raises


@pytest.mark.parametrize(("route", "events"), [
    ("chat", [b'data: {"choices":[{"index":0,"delta":{},"finish_reason":["stop"]},'
              b'{"index":1,"delta":{},"finish_reason":"stop"}]}\n\n']),  # n = 2
    ("messages", [b'data: {"type":"message_delta","delta":{"stop_reason":{"a":1}},'
                  b'"usage":{"output_tokens":5}}\n\n']),
    ("responses", [b'data: {"type":"response.completed","response":{"status":["x"],'
                   b'"output":[],"usage":{"input_tokens":2}}}\n\n']),
])
def test_a_finish_reason_that_is_no_string_is_no_kind(route: Route, events: list[bytes]) -> None:
    tap = StreamTap(route, strip_usage_chunk=False, capture=False)
    sse = SSEFilter(tap)
    for e in events:
        assert sse.feed(e) == e
    assert tap.kind is None
    # A whole reply: its usage is read all the same.
    body = {"choices": [{"index": 0, "message": {}, "finish_reason": ["stop"]}],
            "usage": {"prompt_tokens": 4}}
    usage, _, kind, _ = read_body("chat", json.dumps(body).encode(), capture=False)
    assert usage is not None and usage.prompt_tokens == 4 and kind is None
    calls = {"choices": [{"index": 0, "message": {"tool_calls": [{}]}, "finish_reason": [1]}]}
    assert read_body("chat", json.dumps(calls).encode(), capture=False)[2] \
        is ReplyKind.TOOL_CALL


def test_an_event_of_mebibytes_in_small_reads_is_cut_in_linear_time() -> None:
    """Each read used to copy and search the whole event so far: 4 MiB in 4 KiB reads took
    4 s of the event loop (every client's), 16 MiB a minute."""
    event = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * (4 << 20) + b'"}}]}\n\n'
    for tail in (b"", b"data: [DONE]\r\n\r\n"):
        s, out = SSESplitter(), []
        t = time.perf_counter()
        for i in range(0, len(event), 4096):
            out += s.feed(event[i:i + 4096])
        out += s.feed(tail)
        assert time.perf_counter() - t < 1.0
        assert out == [event, tail] if tail else out == [event]
        assert s.idle()


@settings(max_examples=300, deadline=None)
@given(
    data=st.lists(st.sampled_from([b"a", b"\n", b"\r", b":", b"\r\n", b"\n\n"]), max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=40),
)
def test_held_reads_cut_where_one_read_would(data: list[bytes], cuts: list[int]) -> None:
    """Every read held (as past 64 KiB), at any cuts: the events of the stream read at once."""
    raw = b"".join(data)
    whole = SSESplitter()
    expected = (whole.feed(raw), whole.flush())
    with mock.patch.object(sse_split, "_HOLD_FROM", 0):
        s, out, prev = SSESplitter(), [], 0
        for cut in [*sorted({c % (len(raw) + 1) for c in cuts}), len(raw)]:
            out.extend(s.feed(raw[prev:cut]))
            prev = cut
        assert (out, s.flush()) == expected
