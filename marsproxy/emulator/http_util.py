"""HTTP plumbing the emulator's handlers share: JSON bodies, errors, waiting for tokens, SSE."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from aiohttp import web

from marsproxy.emulator.openai_api import ApiError
from marsproxy.emulator.request import FinishedEvent
from marsproxy.emulator.runner import TokenStream

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
    try:
        return json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        # vLLM (FastAPI) answers a malformed body with type "Bad Request" rather than the
        # "BadRequestError" of its own validation errors.
        raise ApiError(400, f"JSON decode error: {exc}", "Bad Request", "body") from exc


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


async def pump(
    resp: web.StreamResponse, request: web.Request, stream: TokenStream, frames: Frames
) -> None:
    """Write a stream's tokens as they come until it finishes, at most one write per
    ``MIN_WRITE_INTERVAL_S`` (as vLLM's server batches what a step produced); ``frames`` turns
    the tokens not sent yet (and the finish) into a route's events."""
    sent = 0
    loop = asyncio.get_running_loop()
    next_write = 0.0
    while True:
        pause = next_write - loop.time()
        if pause > 0:
            await asyncio.sleep(pause)
        await wait_update(stream, request)
        fin, avail = stream.finished, stream.available
        parts, sent = frames(sent, avail, fin)
        if parts:
            await resp.write(b"".join(parts))
            next_write = loop.time() + MIN_WRITE_INTERVAL_S
        if fin is not None:
            break
    await resp.write_eof()
