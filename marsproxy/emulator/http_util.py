"""HTTP plumbing the emulator's handlers share: JSON bodies, errors, waiting for tokens, SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from aiohttp import web

from marsproxy.emulator.openai_api import ApiError
from marsproxy.emulator.request import FinishedEvent
from marsproxy.emulator.request_fields import fastapi_error
from marsproxy.emulator.runner import EngineRunner, TokenStream

# How often a handler waiting for tokens checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25
# A stream writes to its socket at most once per this many wall seconds; tokens that arrive in
# between go out together in one write (each still its own SSE event). A send() per token per
# stream made tens of tiny-profile streams CPU-bound on 2-core machines.
MIN_WRITE_INTERVAL_S = 0.005
SSE_HEADERS = MappingProxyType(
    {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
)


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=json.dumps(body, separators=(",", ":")).encode(), status=status,
        content_type="application/json",
    )


def error_response(exc: ApiError) -> web.Response:
    return json_response(exc.body(), exc.status)


async def read_json(request: web.Request) -> Any:
    """The body of a POST route as vLLM's FastAPI app reads it: JSON when the content type is
    absent or JSON (a malformed body is its ``json_invalid`` at the offset), then a 400 unless
    the media type is exactly ``application/json`` (vLLM's ``validate_json_request``)."""
    ctype = request.headers.get("Content-Type", "")
    media = ctype.split(";", 1)[0]
    main, _, sub = media.strip().lower().partition("/")
    body: Any = None
    if not ctype or (main == "application" and (sub == "json" or sub.endswith("+json"))):
        try:
            body = json.loads(await request.read())
        except json.JSONDecodeError as exc:
            raise fastapi_error([{"type": "json_invalid", "loc": (exc.pos,),
                                  "msg": "JSON decode error", "input": {},
                                  "ctx": {"error": exc.msg}}]) from exc
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, "There was an error parsing the body", "Bad Request") from exc
    if media.lower() != "application/json":
        raise fastapi_error(["Unsupported Media Type: Only 'application/json' is allowed"])
    return body


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def wait_update(stream: TokenStream, request: web.Request) -> None:
    """Wait for new tokens; raise ConnectionResetError when the client has gone away (aiohttp
    does not cancel handlers on disconnect unless the runner enables handler_cancellation)."""
    while not stream.event.is_set():
        try:
            async with asyncio.timeout(DISCONNECT_POLL_S):
                await stream.event.wait()
        except TimeoutError:
            if client_gone(request):
                raise ConnectionResetError("client disconnected") from None
    stream.event.clear()


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


Frames = Callable[[int, int, FinishedEvent | None], tuple[list[bytes], int]]
"""``(sent, available, finished) -> (bytes to write, tokens sent after them)``."""
Step = Callable[[], tuple[list[bytes], bool]]
"""``() -> (bytes to write, whether the response is complete)``."""


async def pump(
    resp: web.StreamResponse, request: web.Request, stream: TokenStream, frames: Frames
) -> None:
    """Write a stream's tokens as they come until it finishes; ``frames`` turns the tokens not
    sent yet (and the finish) into a route's events."""
    sent = 0

    def step() -> tuple[list[bytes], bool]:
        nonlocal sent
        fin = stream.finished
        parts, sent = frames(sent, stream.available, fin)
        return parts, fin is not None

    await pump_steps(resp, request, stream, step)


async def pump_steps(
    resp: web.StreamResponse, request: web.Request, wake: TokenStream, step: Step
) -> None:
    """Call ``step`` whenever ``wake``'s event fires (the streams of all of a request's choices
    share it) and write what it returns, at most one write per ``MIN_WRITE_INTERVAL_S`` (as
    vLLM's server batches what a step produced), until it says the response is complete."""
    loop = asyncio.get_running_loop()
    next_write = 0.0
    while True:
        pause = next_write - loop.time()
        if pause > 0:
            await asyncio.sleep(pause)
        await wait_update(wake, request)
        parts, done = step()
        if parts:
            await resp.write(b"".join(parts))
            next_write = loop.time() + MIN_WRITE_INTERVAL_S
        if done:
            break
    await resp.write_eof()


async def serve_one(
    request: web.Request, runner: EngineRunner, rid: str, stream: TokenStream, *, streamed: bool,
    frames: Frames, body: Callable[[FinishedEvent], Any],
) -> web.StreamResponse:
    """Answer one engine request ``rid``: as SSE (``frames`` turns its tokens into events) or,
    once finished, as the JSON ``body(finished)``; counted in ``/load`` meanwhile, released (and
    aborted in the engine if still running) at the end, also when the client left."""
    runner.server_load += 1
    try:
        if streamed:
            resp = web.StreamResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            with contextlib.suppress(ConnectionResetError):
                await pump(resp, request, stream, frames)
            return resp
        try:
            while stream.finished is None:
                await wait_update(stream, request)
        except ConnectionResetError:
            return web.Response(status=499)  # nobody reads it; the request is aborted below
        return json_response(body(stream.finished))
    finally:
        runner.server_load -= 1
        runner.release(rid)
