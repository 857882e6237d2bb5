"""The shared encoder of the live event stream: the same bytes as ``encode``, one encoding per
event however many streams read it."""

from __future__ import annotations

from marsproxy.core.events import LlmEnd, ToolStart
from marsproxy.telemetry.sse import SharedEncoder, encode


def test_same_bytes_as_encode_in_both_formats() -> None:
    evs = [ToolStart(ts=1.5, session="t/id/a", tool="pytest"), LlmEnd(ts=2.0, status=502)]
    enc = SharedEncoder()
    for fmt in ("sse", "ndjson"):
        assert enc.encode(evs, fmt) == encode(evs, fmt)  # type: ignore[arg-type]


def test_each_event_is_encoded_once_until_evicted() -> None:
    enc = SharedEncoder(size=2)
    a, b, c = (LlmEnd(ts=float(i)) for i in range(3))
    first = enc.line(a)
    assert enc.line(a) is first  # a second stream gets the kept line
    enc.line(b)
    enc.line(c)  # a is the oldest and goes
    again = enc.line(a)
    assert again == first and again is not first


def test_equal_events_are_told_apart_by_identity() -> None:
    enc = SharedEncoder()
    x, y = LlmEnd(ts=1.0, session="s"), LlmEnd(ts=1.0, session="s")
    assert enc.line(x) == enc.line(y)
    z = LlmEnd(ts=2.0, session="s")
    assert '"ts":2.0' in enc.line(z)
