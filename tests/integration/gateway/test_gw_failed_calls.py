"""A worker's reply fails (cut short, never started, refused, unreadable): the client gets a clear
error or a clean end, and the call leaves nothing behind in admission (one_slot.py): a session
that goes on keeps its slot, a final one frees it, and the next new session is served."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from .one_slot import Rig, one_slot
from .raw_worker import CLOSE, RawWorker, Step, chunk, head

OK_JSON = json.dumps({"id": "c", "object": "chat.completion", "choices": [
    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 7, "completion_tokens": 1}}).encode()
GOOD: list[Step] = [head(ctype="application/json", content_length=str(len(OK_JSON))), OK_JSON]
TEXT = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'


def _json(status: int, body: bytes) -> list[Step]:
    return [head(status, ctype="application/json", content_length=str(len(body))), body]


@pytest.fixture
async def raw() -> AsyncIterator[RawWorker]:
    w = await RawWorker(list(GOOD)).start()
    yield w
    await w.stop()


@pytest.fixture
async def rig(raw: RawWorker, http: aiohttp.ClientSession) -> AsyncIterator[Rig]:
    r = await Rig.start(one_slot([raw.url]), http)
    yield r
    await r.stop()


def _label(raw: RawWorker) -> str:
    return raw.url.split("//")[1]


@pytest.mark.parametrize("final", [False, True])
async def test_a_json_reply_cut_after_its_headers_is_502(
    raw: RawWorker, rig: Rig, final: bool
) -> None:
    """Content-Length promises more than comes before the worker closes the connection."""
    raw.script = [head(ctype="application/json", content_length="400"), OK_JSON[:20], CLOSE]
    r = await rig.call("cut", final=final)
    assert r.status == 502 and r.error()["code"] == "upstream_error", r
    await rig.settled(holding={_label(raw): [] if final else ["cut"]})
    raw.script = list(GOOD)
    if not final:  # the session goes on (the client may retry), then ends
        assert (await rig.call("cut", final=True)).status == 200
    await rig.serves_next()


STREAM_CUTS: dict[str, tuple[list[Step], str]] = {
    # chunked, the connection closed inside the body: no last chunk, no [DONE]
    "chunked-cut": ([head(), chunk(TEXT), CLOSE], "upstream_error"),
    # close-delimited (no length, no chunks): the close is the body's end as HTTP sees it
    "close-delimited": ([b"HTTP/1.1 200 X\r\nContent-Type: text/event-stream\r\n"
                         b"Connection: close\r\n\r\n", TEXT, CLOSE], ""),
}


@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("cut", list(STREAM_CUTS))
async def test_a_stream_cut_without_done_ends_cleanly(
    raw: RawWorker, rig: Rig, cut: str, final: bool
) -> None:
    script, code = STREAM_CUTS[cut]
    raw.script = script
    r = await rig.call("cut", final=final, stream=True)
    assert r.status == 200 and r.events()[0].encode() + b"\n\n" == TEXT, r
    if code:  # a broken framing: the stream says so, then ends well framed
        assert r.stream_error()["code"] == code
    else:  # a clean end as far as HTTP goes: relayed as it came
        assert r.events() == [TEXT.decode().strip()]
    # A final call ends its session however the call ended (docs/admission.md: End).
    await rig.settled(holding={_label(raw): [] if final else ["cut"]})
    raw.script = list(GOOD)
    if not final:
        assert (await rig.call("cut", final=True)).status == 200
    await rig.serves_next()


VLLM_400 = json.dumps({"error": {
    "message": "This model's maximum context length is 4096 tokens. However, you requested "
               "5000 tokens. Please reduce the length of the input messages.",
    "type": "BadRequestError", "param": None, "code": 400}}).encode()
VLLM_404 = json.dumps({"error": {"message": "The model `nope` does not exist.",
                                 "type": "NotFoundError", "param": None, "code": 404}}).encode()


@pytest.mark.parametrize(("status", "body"), [(400, VLLM_400), (404, VLLM_404)])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_worker_refusing_every_call_of_a_session(
    raw: RawWorker, rig: Rig, status: int, body: bytes, stream: bool
) -> None:
    """vLLM's 400/404 to a first call, a continuation and a final call: each passes through
    as vLLM sent it; the session keeps its slot between them and frees it at the final."""
    raw.script = _json(status, body)
    label = _label(raw)
    for final in (False, False, True):
        r = await rig.call("refused", final=final, stream=stream)
        assert (r.status, r.text.encode()) == (status, body), r
        await rig.settled(holding={label: [] if final else ["refused"]})
    raw.script = list(GOOD)
    await rig.serves_next()


@pytest.mark.parametrize("final", [False, True])
async def test_invalid_json_with_200_is_relayed_as_sent(
    raw: RawWorker, rig: Rig, final: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The proxy relays what the worker said, as every reply it cannot read (docs/reliability.md:
    a worker's odd counts); no usage is read from it, a log line says so, and the call ends."""
    bad = b'{"id":"c","usage":{"prompt_tokens":7,'  # cut short: the tap parses it, and fails
    raw.script = _json(200, bad)
    r = await rig.call("garbled", final=final)
    assert (r.status, r.text.encode()) == (200, bad)
    assert any("no usage read from it" in rec.getMessage() for rec in caplog.records)
    await rig.settled(holding={_label(raw): [] if final else ["garbled"]})
    raw.script = list(GOOD)
    if not final:
        assert (await rig.call("garbled", final=True)).status == 200
    await rig.serves_next()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("final", [False, True])
async def test_no_headers_within_the_first_byte_timeout_is_504(
    fake: Any, http: aiohttp.ClientSession, until: Any, final: bool, stream: bool
) -> None:
    rig = await Rig.start(one_slot([fake.url], upstream={"first_byte_timeout_s": 0.2}), http)
    try:
        r = await rig.call("silent", final=final, stream=stream, headers={"x-fake": "hang"})
        assert r.status == 504 and r.error()["code"] == "upstream_timeout", r
        await until(lambda: fake.active == 0)  # the worker's request was closed
        await rig.settled(holding={fake.url.split("//")[1]: [] if final else ["silent"]})
        if not final:
            assert (await rig.call("silent", final=True)).status == 200
        await rig.serves_next()
    finally:
        await rig.stop()
