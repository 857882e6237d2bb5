"""Wire forms of ``GET /mars/v1/events``: SSE or NDJSON lines, and the stream's filters.

Pure: the gateway's handler does the I/O. Events go out as :func:`event_to_dict` gives them, so
the live stream, the JSONL file and the Redis stream carry the same objects.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Literal

from marsproxy.core.events import EVENT_TYPES, Event, event_to_dict
from marsproxy.telemetry.bus import EventFilter

StreamFormat = Literal["sse", "ndjson"]

# SSE comment lines are ignored by every client; NDJSON readers get a blank line instead.
KEEPALIVE: dict[StreamFormat, bytes] = {"sse": b": keep-alive\n\n", "ndjson": b"\n"}
CONTENT_TYPE: dict[StreamFormat, str] = {
    "sse": "text/event-stream",
    "ndjson": "application/x-ndjson",
}


class FilterError(ValueError):
    """A query parameter of the event stream that cannot be used; names the parameter."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def encode(events: Iterable[Event], fmt: StreamFormat) -> bytes:
    out: list[str] = []
    for ev in events:
        data = json.dumps(event_to_dict(ev), separators=(",", ":"))
        out.append(f"event: {ev.type}\ndata: {data}\n\n" if fmt == "sse" else data + "\n")
    return "".join(out).encode()


class SharedEncoder:
    """Encodes each event once for every live stream.

    All subscribers read the same :class:`Event` objects from the bus, so an event's JSON is kept
    by identity for the streams that read it later: five open pages cost one encoding per
    event, not five. The cache holds the event itself (so its id cannot be reused while cached)
    and forgets the oldest past ``size``; a stream further behind encodes again.
    """

    def __init__(self, size: int = 8192) -> None:
        self._size = size
        self._lines: OrderedDict[int, tuple[Event, str]] = OrderedDict()

    def line(self, ev: Event) -> str:
        hit = self._lines.get(id(ev))
        if hit is not None and hit[0] is ev:
            return hit[1]
        data = json.dumps(event_to_dict(ev), separators=(",", ":"))
        self._lines[id(ev)] = (ev, data)
        if len(self._lines) > self._size:
            self._lines.popitem(last=False)
        return data

    def encode(self, events: Iterable[Event], fmt: StreamFormat) -> bytes:
        """What :func:`encode` gives, from the shared lines."""
        if fmt == "sse":
            return "".join(f"event: {ev.type}\ndata: {self.line(ev)}\n\n" for ev in events).encode()
        return "".join(self.line(ev) + "\n" for ev in events).encode()


def parse_types(raw: str | None) -> frozenset[str] | None:
    """``"llm_end,tool_start"`` → the set; unknown names are an error naming them."""
    if raw is None or not raw.strip():
        return None
    names = frozenset(t.strip() for t in raw.split(",") if t.strip())
    unknown = sorted(names - EVENT_TYPES.keys())
    if unknown:
        raise FilterError(
            "type",
            f"unknown event type(s) {', '.join(unknown)}; known: {', '.join(sorted(EVENT_TYPES))}",
        )
    return names


def event_filter(
    types: frozenset[str] | None,
    session: str | None,
    id_of: Callable[[str], str],
) -> EventFilter | None:
    """Accept events of ``types`` (all if None) of the session whose unscoped id is ``session``."""
    if types is None and session is None:
        return None

    def accept(ev: Event) -> bool:
        if types is not None and ev.type not in types:
            return False
        if session is not None:
            return ev.session is not None and id_of(ev.session) == session
        return True

    return accept
