"""Server-sent events: split a byte stream into events (``sse_split.py``), and tap events for
usage, replies and (Responses API) the reply's id.

The relay forwards each upstream event's bytes unchanged as soon as the event is complete; the
taps here only look. JSON is parsed only for events that can hold what is needed (a cheap
substring check first), and reply text is collected only for chain-matched sessions.

Pure code: no I/O.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from marsproxy.core.answers import ReplyKind
from marsproxy.core.canon import (
    Reply,
    anthropic_message_unit,
    chat_reply_unit,
    responses_output_units,
)
from marsproxy.core.identity import Route
from marsproxy.gateway.http.reply_kind import body_kind, first_choice, kind_of, responses_kind
from marsproxy.gateway.http.sse_split import SSESplitter

log = logging.getLogger("marsproxy.gateway.http.sse")

# A finish reason that is set (a string), as compact or spaced JSON writes it.
_FINISH, _FINISH_SPACED = b'"finish_reason":"', b'"finish_reason": "'
UNREADABLE = (ValueError, TypeError, AttributeError, RecursionError)  # a worker's odd JSON


class SSEFilter:
    """What to forward of each upstream chunk: the tap's verdict on every event, at chunk speed.

    A chunk made only of whole events that the tap would pass without looking (the common
    case: no usage, no error, no reply to capture) is forwarded as the very same bytes object,
    neither split nor copied; anything else goes event by event through the splitter.
    """

    def __init__(self, tap: StreamTap) -> None:
        self.tap = tap
        self._splitter = SSESplitter()

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to forward now (possibly empty: an event is incomplete, or dropped)."""
        whole = self._splitter.idle()
        if whole and chunk.endswith(b"\n\n") and self.tap.passes(chunk):
            return chunk
        events = self._splitter.feed(chunk)
        kept = [e for e in events if self.tap.keep(e)]
        if whole and len(kept) == len(events) and self._splitter.idle():
            return chunk  # looked at, nothing dropped: the chunk as it came, not a copy
        return kept[0] if len(kept) == 1 else b"".join(kept)

    def flush(self) -> bytes:
        """What is left after the last chunk (an event without its blank line), if kept."""
        rest = self._splitter.flush()
        return rest if rest and self.tap.keep(rest) else b""


def event_data(event: bytes) -> bytes:
    """The event's ``data:`` payload (lines joined by newlines)."""
    parts = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(parts)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @staticmethod
    def of(obj: Any) -> Usage | None:
        """OpenAI (prompt/completion), responses (input/output) or Anthropic usage objects.

        Anthropic's ``input_tokens`` counts only the prompt tokens neither read from nor written
        to the cache (vLLM subtracts ``cache_read_input_tokens`` and
        ``cache_creation_input_tokens`` from its prompt count), so the prompt is their sum.
        """
        if not isinstance(obj, dict):
            return None
        prompt = _int(obj.get("prompt_tokens", obj.get("input_tokens")))
        completion = obj.get("completion_tokens", obj.get("output_tokens"))
        details = obj.get("prompt_tokens_details") or obj.get("input_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if cached is None and ("cache_read_input_tokens" in obj
                               or "cache_creation_input_tokens" in obj):
            cached = _int(obj.get("cache_read_input_tokens"))
            prompt += cached + _int(obj.get("cache_creation_input_tokens"))
        return Usage(prompt, _int(completion), _int(cached))


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the stack
        return None


@dataclass
class _Capture:
    text: list[str] = field(default_factory=list)
    calls: dict[int, list[str]] = field(default_factory=dict)  # index → [name, args...]


class StreamTap:
    """Watches one SSE response of a scheduled route.

    ``keep(event)`` says whether to forward the event: the only event ever dropped is the
    usage-only chat/completions chunk the proxy asked for on the client's behalf. ``kinds``:
    read whether the reply called a tool or answered (only a request that offered tools is an
    agent loop's call: ``reply_kind.py``); without it no chunk is looked into for that.
    """

    def __init__(self, route: Route, *, strip_usage_chunk: bool, capture: bool,
                 kinds: bool = True, created: bool = False) -> None:
        self.route = route
        self._created = created  # a background stream: its id is wanted from its first event
        self._kinds = kinds
        self.usage: Usage | None = None
        self._strip = strip_usage_chunk
        self._capture = _Capture() if capture else None
        self._responses_output: list[bytes] | None = None
        self.response_id: str | None = None  # a Responses reply's, for previous_response_id
        self.saw_error = False
        self._calls_tool = False  # the reply's kind (reply_kind.py)
        self._finish: object = None

    def keep(self, event: bytes) -> bool:
        try:
            if self.route in ("chat", "completions"):
                return self._openai(event)
            if self.route == "responses":
                self._responses(event)
            else:
                self._messages(event)
        except UNREADABLE as exc:  # nested too deep, or of the wrong shape: sent as it came
            log.warning("%s stream: an event forwarded unread: %r", self.route, exc)
        return True

    def passes(self, data: bytes) -> bool:
        """True when ``keep`` would forward every event in ``data`` without looking into it.

        A substring test on the whole chunk: none of the markers spans a blank line, so a
        marker absent from the chunk is absent from each of its events.
        """
        if self.route == "responses":
            return (b"response.completed" not in data and b"response.failed" not in data
                    and not (self._created and b"response.created" in data))
        return (self._capture is None and b'"usage"' not in data and b'"error"' not in data
                and not self._ends_or_calls(data))

    @property
    def kind(self) -> ReplyKind | None:
        """Whether the reply called a tool or answered (``None``: neither, not seen, or not
        read: ``kinds``)."""
        return kind_of(self._calls_tool, self._finish) if self._kinds else None

    def _ends_or_calls(self, data: bytes) -> bool:
        """Whether ``data`` may hold the finish reason, or the reply's first tool call."""
        if not self._kinds:
            return False
        if self.route == "messages":
            return not self._calls_tool and b'"tool_use"' in data
        return (_FINISH in data or _FINISH_SPACED in data
                or (not self._calls_tool and b'"tool_calls"' in data))

    def reply(self) -> Reply | None:
        """The reply in the form the client will echo next turn (capture only)."""
        cap = self._capture
        if cap is None:
            return None
        if self.route == "responses":
            return None if self._responses_output is None else Reply(tuple(self._responses_output))
        text = "".join(cap.text)
        calls = [(c[0], "".join(c[1:])) for _, c in sorted(cap.calls.items())]
        if self.route == "completions":
            return Reply(text=text)
        if self.route == "messages":
            return Reply((messages_reply_unit(text, calls),))
        return Reply((chat_reply_unit(text, calls),))

    def _openai(self, event: bytes) -> bool:
        has_usage = b'"usage"' in event and b'"usage":null' not in event
        if (not has_usage and self._capture is None and b'"error"' not in event
                and not self._ends_or_calls(event)):
            return True  # the common case: forward without looking further
        data = event_data(event)
        if not data or data == b"[DONE]":
            return True
        obj = _loads(data)
        if not isinstance(obj, dict):
            return True
        if "error" in obj:
            self.saw_error = True
        if has_usage:
            usage = Usage.of(obj.get("usage"))
            if usage is not None:
                self.usage = usage
                if self._strip and obj.get("choices") == []:
                    return False
        ch = first_choice(obj)  # n > 1: the client continues with the first choice
        if ch is None:
            return True
        self._finish = ch.get("finish_reason") or self._finish
        self._calls_tool = self._calls_tool or bool((ch.get("delta") or {}).get("tool_calls"))
        if self._capture is not None:
            self._capture_openai(ch)
        return True

    def _capture_openai(self, ch: dict[str, Any]) -> None:
        """The reply text and tool calls of one chunk's first choice."""
        assert self._capture is not None
        if self.route == "completions":
            if isinstance(ch.get("text"), str):
                self._capture.text.append(ch["text"])
            return
        delta = ch.get("delta") or {}
        if isinstance(delta.get("content"), str):
            self._capture.text.append(delta["content"])
        for tc in delta.get("tool_calls") or ():
            fn = tc.get("function") or {}
            slot = self._capture.calls.setdefault(int(tc.get("index", 0)), [""])
            if fn.get("name"):
                slot[0] += fn["name"]
            if isinstance(fn.get("arguments"), str):
                slot.append(fn["arguments"])

    def _responses(self, event: bytes) -> None:
        created = self._created and b"response.created" in event
        if b"response.completed" not in event and b"response.failed" not in event and not created:
            return
        obj = _loads(event_data(event))
        if not isinstance(obj, dict) or not isinstance(obj.get("response"), dict):
            return
        resp = obj["response"]
        if obj.get("type") == "response.created":  # the id, should the client leave before the end
            self._created = False
            self.response_id = _response_id(resp)
            return
        if obj.get("type") == "response.failed":
            self.saw_error = True
        self._calls_tool = responses_kind(resp) is ReplyKind.TOOL_CALL
        self._finish = resp.get("status")
        self.usage = Usage.of(resp.get("usage")) or self.usage
        self.response_id = _response_id(resp)
        if self._capture is not None:
            self._responses_output = responses_output_units(resp.get("output"))

    def _messages(self, event: bytes) -> None:
        if (self._capture is None and b'"usage"' not in event and b'"error"' not in event
                and not self._ends_or_calls(event)):
            return
        obj = _loads(event_data(event))
        if not isinstance(obj, dict):
            return
        kind = obj.get("type")
        if kind == "error":
            self.saw_error = True
        elif kind == "message_start":
            self.usage = Usage.of((obj.get("message") or {}).get("usage")) or self.usage
        elif kind == "content_block_start":
            block = obj.get("content_block")
            self._calls_tool |= isinstance(block, dict) and block.get("type") == "tool_use"
        elif kind == "message_delta":
            self._finish = (obj.get("delta") or {}).get("stop_reason") or self._finish
            delta = Usage.of(obj.get("usage"))
            if delta is not None:
                base = self.usage or Usage()
                # message_delta carries the cumulative output count and (vLLM) the prompt with
                # its cache split; message_start's input count stands where it has none.
                self.usage = Usage(
                    delta.prompt_tokens or base.prompt_tokens,
                    delta.completion_tokens,
                    delta.cached_tokens or base.cached_tokens,
                )
        if self._capture is not None:
            self._capture_messages(kind, obj)

    def _capture_messages(self, kind: Any, obj: dict[str, Any]) -> None:
        assert self._capture is not None
        idx = int(obj.get("index", 0) or 0)
        if kind == "content_block_start":
            block = obj.get("content_block") or {}
            if block.get("type") == "tool_use":
                self._capture.calls[idx] = [str(block.get("name", ""))]
            elif isinstance(block.get("text"), str):
                self._capture.text.append(block["text"])
        elif kind == "content_block_delta":
            delta = obj.get("delta") or {}
            if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
                self._capture.text.append(delta["text"])
            elif delta.get("type") == "input_json_delta" and idx in self._capture.calls:
                self._capture.calls[idx].append(str(delta.get("partial_json", "")))


def messages_reply_unit(text: str, calls: list[tuple[str, str]]) -> bytes:
    """The assistant message an Anthropic client echoes: text and tool_use blocks."""
    content: list[dict[str, Any]] = []
    if text:
        content.append({"type": "text", "text": text})
    for name, args in calls:
        content.append({"type": "tool_use", "name": name, "input": _loads(args.encode()) or {}})
    return anthropic_message_unit({"role": "assistant", "content": content})


def read_body(
    route: Route, body: bytes, *, capture: bool, kinds: bool = True
) -> tuple[Usage | None, Reply | None, ReplyKind | None, str | None]:
    """Usage, the reply's kind (``kinds``: read, as by :class:`StreamTap`), for chain sessions
    the reply, and a Responses reply's id, of a non-streaming response body."""
    if not capture and not kinds and route != "responses" and b'"usage"' not in body:
        return None, None, None, None  # nothing to read: not parsed
    obj = json.loads(body)  # a worker's 2xx that is not JSON: the caller logs it (UNREADABLE)
    if not isinstance(obj, dict):
        raise TypeError(f"a JSON {type(obj).__name__}, not an object")
    usage = Usage.of(obj.get("usage"))
    kind = body_kind(route, obj) if kinds else None
    rid = _response_id(obj) if route == "responses" else None
    return usage, _body_reply(route, obj) if capture else None, kind, rid


def _response_id(resp: dict[str, Any]) -> str | None:
    rid = resp.get("id")
    return rid if isinstance(rid, str) and rid else None


def _body_reply(route: Route, obj: dict[str, Any]) -> Reply | None:
    if route == "responses":
        return Reply(tuple(responses_output_units(obj.get("output"))))
    if route == "messages":
        text = ""
        calls: list[tuple[str, str]] = []
        for block in obj.get("content") or ():
            if block.get("type") == "text":
                text += str(block.get("text", ""))
            elif block.get("type") == "tool_use":
                calls.append((str(block.get("name", "")), json.dumps(block.get("input", {}))))
        return Reply((messages_reply_unit(text, calls),))
    choices = obj.get("choices") or []  # of the wrong shape: raises (relay.py names it)
    first = next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), None)
    if first is None:
        return None
    if route == "completions":
        return Reply(text=str(first.get("text") or ""))
    msg = first.get("message") or {}
    calls = []
    for tc in msg.get("tool_calls") or ():
        fn = tc.get("function") or {}
        calls.append((str(fn.get("name", "")), str(fn.get("arguments", ""))))
    return Reply((chat_reply_unit(str(msg.get("content") or ""), calls),))
