"""The gateway in front of a worker that writes scripted raw bytes (raw_worker.py): odd SSE
framing, JSON the tap cannot read. The client gets what it would get from the worker directly
(less the usage chunk the proxy asked for), the call ends, and the connection stays clean."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from marsproxy.gateway.http.app import Running

from .raw_worker import RawWorker, Step, chunk, chunked, head
from .relay_client import CHAT, config, gateway, url

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
STREAM = {**CHAT, "stream": True, "tools": TOOLS}
MESSAGES = {"model": "fake", "max_tokens": 8, "stream": True, "tools": [{"name": "f"}],
            "messages": [{"role": "user", "content": "hi"}]}
DEEP = b"[" * 100_000 + b"]" * 100_000  # nested deeper than the interpreter's stack


def ev(obj: dict[str, Any], nl: bytes = b"\n", name: str = "") -> bytes:
    line = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + nl
    return (f"event: {name}".encode() + nl if name else b"") + line + nl


def text(c: str, finish: str | None = None) -> bytes:
    return ev({"id": "c", "choices": [{"index": 0, "delta": {"content": c},
                                        "finish_reason": finish}]})


USAGE = ev({"id": "c", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
DONE = b"data: [DONE]\n\n"
START = ev({"type": "message_start", "message": {"id": "m", "role": "assistant",
                                                  "usage": {"input_tokens": 11}}},
           name="message_start")


async def _call(g: Running, http: aiohttp.ClientSession, path: str, body: Any) -> bytes:
    async with http.post(url(g, path), json=body, headers={"x-session-id": "s"}) as r:
        assert r.status == 200
        return await r.read()


async def _relayed(worker: RawWorker, path: str, body: Any) -> tuple[bytes, bytes, str]:
    """What the client gets from the worker directly, then through the proxy twice on one
    connection (a response that leaves stray bytes behind breaks the second), and the proxy's
    metrics page after."""
    async with aiohttp.ClientSession() as http, http.post(worker.url + path, json=body) as r:
        direct = await r.read()
    g = await gateway(config([worker.url]))
    gw = g.gateway
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
            via = await _call(g, http, path, body)
            assert await _call(g, http, path, body) == via
            async with http.get(url(g, "/metrics")) as r:
                metrics = await r.text()
        sess = gw.sessions.get("anon/id/s")
        assert sess is not None and not sess.in_flight  # the call ended
        assert gw.metrics.in_flight.value == 0 and gw.in_flight_by_worker[worker.url] == 0
    finally:
        await g.stop()
    return direct, via, metrics


@pytest.mark.parametrize(("path", "body", "script"), [
    ("/v1/chat/completions", STREAM,  # nested too deep for json.loads: RecursionError
     [head(), *chunked(text("a"), b'data: {"choices":[],"usage":{},"x":' + DEEP + b"}\n\n",
                       DONE)]),
    ("/v1/chat/completions", STREAM,  # a delta that is no object, in the finishing chunk
     [head(), *chunked(text("a"), b'data: {"choices":[{"index":0,"delta":"x",'
                       b'"finish_reason":"stop"}]}\n\n', USAGE, DONE)]),
    ("/v1/messages", MESSAGES,  # a message_start whose message is no object
     [head(), *chunked(b'event: message_start\ndata: {"type":"message_start","message":"m",'
                       b'"usage":{}}\n\n', ev({"type": "message_stop"}))]),
], ids=["deep", "delta-string", "message-string"])
async def test_an_event_the_tap_cannot_read_reaches_the_client_as_it_came(
    path: str, body: Any, script: list[Step]
) -> None:
    """Such an event raised in the tap after the headers had left: the proxy's 500 response
    was written into the open stream, and the client lost it all (a chunk-size error)."""
    worker = await RawWorker(script).start()
    try:
        direct, via, _ = await _relayed(worker, path, body)
        assert via == direct.replace(USAGE, b"")
    finally:
        await worker.stop()


@pytest.mark.parametrize(("path", "body", "script", "prompt"), [
    ("/v1/chat/completions", {**STREAM, "n": 2},
     [head(), *chunked(text("a"), ev({"id": "c", "choices": [
         {"index": 0, "delta": {}, "finish_reason": ["stop"]},
         {"index": 1, "delta": {}, "finish_reason": "stop"}]}), USAGE, DONE)], 7),
    ("/v1/messages", MESSAGES,
     [head(), *chunked(START, ev({"type": "message_delta", "delta": {"stop_reason": {"a": 1}},
                                  "usage": {"output_tokens": 5}}, name="message_delta"),
                       ev({"type": "message_stop"}, name="message_stop"))], 11),
    ("/v1/chat/completions", CHAT | {"tools": TOOLS},
     [head(ctype="application/json", content_length="91"), json.dumps(
         {"choices": [{"index": 0, "message": {}, "finish_reason": ["stop"]}],
          "usage": {"prompt_tokens": 7}}, separators=(",", ":")).encode()], 7),
], ids=["chat-finish-list", "messages-stop-object", "json-finish-list"])
async def test_a_finish_reason_that_is_no_string_is_relayed_and_counted(
    path: str, body: Any, script: list[Step], prompt: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Its kind raised: once a stream had left (an internal error logged, the connections
    closed), or before a JSON reply's usage was read (its tokens never counted)."""
    worker = await RawWorker(script).start()
    try:
        direct, via, metrics = await _relayed(worker, path, body)
        assert via == direct.replace(USAGE, b"")
        assert f'marsproxy_tokens_total{{kind="prompt"}} {2.0 * prompt}' in metrics
        assert not [r for r in caplog.records if r.levelname == "ERROR"]
    finally:
        await worker.stop()


CRLF = ev({"id": "c", "choices": [{"index": 0, "delta": {"content": "a"}}]}, b"\r\n")
MULTI = b'data: {"id":"c","choices":[],\ndata: "usage":{"prompt_tokens":7}}\n\n'
STREAMS: dict[str, list[Step]] = {
    "byte-by-byte": [head(), *(chunk(bytes([b])) for b in text("a") + USAGE + DONE),
                     b"0\r\n\r\n"],
    "crlf-and-comments": [head(), *chunked(b": ping\n\n", CRLF + b": ping\r\n\r\n",
                                           USAGE.replace(b"\n", b"\r\n"), DONE)],
    "multi-line-usage": [head(), *chunked(text("a"), MULTI, DONE)],
    "two-usage-not-last": [head(), *chunked(USAGE, text("a"), USAGE, DONE, text("z"))],
    "no-blank-line-at-eof": [head(), *chunked(text("a"), USAGE, b"data: [DONE]")],
    "no-done": [head(), *chunked(text("a", "stop"), USAGE)],
    "json-body": [head(), *chunked(b'{"id":"c","choices":[],"usage":{"prompt_tokens":7}}')],
}


@pytest.mark.parametrize("name", list(STREAMS))
async def test_odd_framing_is_relayed_as_the_worker_sent_it(name: str) -> None:
    worker = await RawWorker(STREAMS[name]).start()
    try:
        direct, via, _ = await _relayed(worker, "/v1/chat/completions", STREAM)
        dropped = (USAGE, USAGE.replace(b"\n", b"\r\n"), MULTI)
        expected = direct
        for usage in dropped:
            expected = expected.replace(usage, b"")
        assert via == expected
    finally:
        await worker.stop()
