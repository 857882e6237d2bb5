"""Relaying a worker's response to the client: buffered (JSON) or streamed (SSE, tapped for
usage and the reply), a worker gone silent or failing mid-response answered as an error, a client
gone mid-stream aborting the worker's request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
from aiohttp import web

from marsproxy.core.identity import Route
from marsproxy.core.sessions import Turn
from marsproxy.gateway.http.errors import sse_error_event
from marsproxy.gateway.http.sse import SSEFilter, StreamTap
from marsproxy.gateway.http.upstream import Opened, response_headers
from marsproxy.gateway.shells.outcome import Clock, Outcome, RequestEvents, error
from marsproxy.gateway.shells.service import Gateway

log = logging.getLogger("marsproxy.gateway.http.relay")

CLIENT_GONE = 499  # nginx's code for "client closed request"; only ever a metrics label


async def buffered(
    gw: Gateway,
    events: RequestEvents,
    route: Route,
    opened: Opened,
    clock: Clock,
    out: Outcome,
) -> web.StreamResponse:
    upstream = opened.response
    chunks: list[bytes] = []
    t = time.perf_counter()
    try:
        while chunk := await opened.body.read():
            chunks.append(chunk)
        clock.upstream_s += time.perf_counter() - t
    except TimeoutError:
        clock.upstream_s += time.perf_counter() - t
        gw.metrics.upstream_errors.labels(opened.worker.label, "idle_timeout").inc()
        return error(
            clock,
            out,
            504,
            "upstream_timeout",
            f"worker {opened.worker.label} went silent mid-response for "
            f"{gw.cfg.upstream.idle_timeout_s} s",
        )
    except aiohttp.ClientError as exc:
        clock.upstream_s += time.perf_counter() - t
        gw.metrics.upstream_errors.labels(opened.worker.label, "protocol").inc()
        return error(
            clock,
            out,
            502,
            "upstream_error",
            f"worker {opened.worker.label} failed mid-response: {exc!r}",
        )
    body = b"".join(chunks)
    out.status = upstream.status
    if upstream.status < 400:
        out.body, out.ok = body, True  # its usage is read after it has left (relay.py)
        events.first_token(out, clock)
    else:
        log.info("worker %s answered %d on %s", opened.worker.label, upstream.status, route)
        if upstream.status >= 500:  # e.g. vLLM's 503 "engine busy": overload, worth a graph
            gw.metrics.upstream_errors.labels(opened.worker.label, "http_5xx").inc()
    headers = response_headers(upstream.headers)  # the overhead header: as it leaves (relay.py)
    return web.Response(status=upstream.status, body=body, headers=headers)

async def stream(
    gw: Gateway,
    events: RequestEvents,
    request: web.Request,
    route: Route,
    opened: Opened,
    strip: bool,
    turn: Turn,
    clock: Clock,
    out: Outcome,
) -> web.StreamResponse:
    upstream = opened.response
    tap = StreamTap(route, strip_usage_chunk=strip, capture=turn.capture_reply,
                    kinds=out.offers_tools, created=out.credentials is not None)
    sse = SSEFilter(tap)
    headers = response_headers(upstream.headers)
    headers.update(clock.header())
    resp = web.StreamResponse(status=upstream.status, headers=headers)
    out.status = upstream.status
    await resp.prepare(request)
    try:
        return await _pump(gw, events, opened, sse, tap, resp, clock, out)
    except asyncio.CancelledError:
        out.status = CLIENT_GONE
        raise
    except Exception:
        # A bug of ours after the headers left: a 500 written now would land inside the open
        # stream. The stream ends with an error event instead, and the worker's request stops.
        log.exception("relaying a %s stream of session %s failed", route, out.session)
        upstream.close()
        await _cut(resp, sse_error_event("internal error of the proxy mid-stream",
                                         code="internal_error", status=500))
        return resp
    finally:
        if out.status == CLIENT_GONE:  # a background response goes on without its client
            out.response_id = tap.response_id


async def _pump(
    gw: Gateway, events: RequestEvents, opened: Opened, sse: SSEFilter, tap: StreamTap,
    resp: web.StreamResponse, clock: Clock, out: Outcome,
) -> web.StreamResponse:
    """The worker's stream to the client, chunk by chunk, until it ends or fails."""
    upstream = opened.response
    while True:
        try:
            chunk = await opened.body.read()
        except TimeoutError:
            gw.metrics.upstream_errors.labels(opened.worker.label, "idle_timeout").inc()
            await _cut(
                resp,
                sse_error_event(
                    f"worker {opened.worker.label} went silent for "
                    f"{gw.cfg.upstream.idle_timeout_s} s",
                    code="upstream_timeout",
                ),
            )
            return resp
        except aiohttp.ClientError as exc:
            gw.metrics.upstream_errors.labels(opened.worker.label, "protocol").inc()
            await _cut(
                resp,
                sse_error_event(
                    f"worker {opened.worker.label} failed mid-stream: {exc!r}",
                    code="upstream_error",
                    status=502,
                ),
            )
            return resp
        if not chunk:
            break
        data = sse.feed(chunk)
        if data:
            events.first_token(out, clock)
            if not await _write(resp, data, upstream, out):
                return resp
    rest = sse.flush()
    if rest and not await _write(resp, rest, upstream, out):
        return resp
    await resp.write_eof()
    out.usage = tap.usage
    out.ok = not tap.saw_error
    out.reply = tap.reply() if out.ok else None
    out.reply_kind = tap.kind if out.ok else None
    out.response_id = tap.response_id if out.ok else None
    return resp

async def _write(
    resp: web.StreamResponse, data: bytes, upstream: aiohttp.ClientResponse, out: Outcome
) -> bool:
    """Write to the client; if it is gone, abort the worker's request at once."""
    try:
        await resp.write(data)
    except ConnectionError:
        log.info("client went away mid-stream; aborting the upstream request")
        upstream.close()
        out.status = CLIENT_GONE
        return False
    return True

async def _cut(resp: web.StreamResponse, event: bytes) -> None:
    with contextlib.suppress(ConnectionError):
        await resp.write(event)
        await resp.write_eof()


def done(opened: Opened, completed: bool) -> None:
    """Back to the pool when read to the end; otherwise (client gone, stream cut) close the
    connection, which aborts the worker's request."""
    opened.body.close()
    upstream = opened.response
    if completed:
        upstream.release()
    else:
        upstream.close()
