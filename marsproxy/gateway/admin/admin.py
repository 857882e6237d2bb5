"""The admin API under ``/mars/v1/``: tool events from agents, ending sessions, the live event
stream and the state document.

Session endpoints are tenant-scoped like the gateway: the session key is scoped by the hash of
the request's API key, so another key gets 404 for the same id; each session may post
``limits.session_events_per_s`` tool events (429 beyond). ``/events``, ``/state`` and
``/openapi.json`` are operator endpoints: they need ``auth.admin_token`` once one is set
(``auth.py``). The routes here and ``openapi.py`` describe the same API; a test holds them equal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable

from aiohttp import web
from pydantic import ValidationError

from marsproxy.core.events import Event
from marsproxy.core.identity import tenant_of
from marsproxy.gateway.admin.admin_models import (
    EVENTS_QUERY,
    MAX_FLUSH_MS,
    MAX_OFFSET,
    MAX_PAGE,
    STATE_QUERY,
    ToolEventBody,
)
from marsproxy.gateway.admin.openapi import build_openapi
from marsproxy.gateway.admin.query import QueryError, check_names, flag, integer, shown
from marsproxy.gateway.admin.state import build_state
from marsproxy.gateway.http.bodies import BodyError, read_limited
from marsproxy.gateway.http.errors import error_response
from marsproxy.gateway.http.limits import ROUTE_ARGS
from marsproxy.gateway.http.routes import allowed_methods, method_not_allowed
from marsproxy.gateway.shells.event_rate import EventRate
from marsproxy.gateway.shells.service import Gateway
from marsproxy.gateway.shells.sessions import keys_for, unscoped_id
from marsproxy.telemetry.bus import Subscription
from marsproxy.telemetry.sse import (
    CONTENT_TYPE,
    KEEPALIVE,
    FilterError,
    SharedEncoder,
    StreamFormat,
    event_filter,
    parse_types,
)

log = logging.getLogger("marsproxy.gateway.admin")


def _bad(message: str, code: str = "invalid_request", param: str | None = None) -> web.Response:
    return error_response(400, message, code=code, param=param)


def _bad_query(exc: QueryError) -> web.Response:
    return _bad(str(exc), param=exc.param)


def _query_names(request: web.Request, allowed: frozenset[str]) -> web.Response | None:
    """The 400 for a query parameter the route does not take (or one given twice)."""
    try:
        check_names((k for k, _ in request.query.items()), allowed)
    except QueryError as exc:
        return _bad_query(exc)
    return None


def _tenant(request: web.Request) -> str:
    # Same rule as the relay: Anthropic-style clients send x-api-key instead.
    return tenant_of(request.headers.get("Authorization") or request.headers.get("x-api-key"))


class Admin:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._closing = asyncio.Event()
        self._writes: set[asyncio.Timeout] = set()  # event-stream writes under way
        lim = gw.cfg.limits
        self._rate = EventRate(lim.session_events_per_s, lim.session_events_burst)
        self._openapi = build_openapi(auth=bool(gw.cfg.auth.admin_token.get_secret_value()))
        self._encoder = SharedEncoder()  # one encoding per event for all open streams

    def add_routes(self, app: web.Application) -> None:
        r = app.router
        # No implicit HEAD: the OpenAPI document lists exactly these.
        kw = ROUTE_ARGS
        r.add_post("/mars/v1/sessions/{id:.+}/events", self.tool_event, **kw)
        r.add_delete("/mars/v1/sessions/{id:.+}", self.delete_session, **kw)
        r.add_get("/mars/v1/events", self.events, allow_head=False, **kw)
        r.add_get("/mars/v1/state", self.state, allow_head=False, **kw)
        r.add_get("/mars/v1/openapi.json", self.openapi, allow_head=False, **kw)
        # Anything else under /mars/ is the proxy's own namespace: never passed to a worker
        # (a 404, or a 405 for a known path).
        r.add_route("*", "/mars/{tail:.*}", self.unknown, **kw)
        app.on_shutdown.append(self._shutdown)

    async def _shutdown(self, _: web.Application) -> None:
        # Live event streams never end by themselves; end them so shutdown need not wait.
        self._closing.set()
        for write in self._writes:  # blocked on a reader that takes nothing: end them now
            if not write.expired():
                write.reschedule(0)

    async def unknown(self, request: web.Request) -> web.Response:
        allowed = await allowed_methods(request)
        if allowed:  # a known path with another method
            return method_not_allowed(request, allowed)
        return error_response(
            404, f"no admin endpoint {request.method} {request.path}", code="not_found"
        )

    def _find(self, request: web.Request) -> tuple[str, str | None]:
        """The session's id and key (None: not one of this API key's sessions)."""
        sid = request.match_info["id"]
        tenant = _tenant(request)
        for key in keys_for(tenant, sid):
            if self.gw.sessions.get(key) is not None:
                return sid, key
        return sid, None

    @staticmethod
    def _not_found(sid: str) -> web.Response:
        # The id is the client's: bounded in the message and its log line.
        return error_response(
            404, f"no session {shown(sid, 100)} for this API key", code="session_not_found"
        )

    async def openapi(self, request: web.Request) -> web.Response:
        return _query_names(request, frozenset()) or web.json_response(self._openapi)

    async def tool_event(self, request: web.Request) -> web.Response:
        refused = _query_names(request, frozenset())
        if refused is not None:
            return refused
        sid, key = self._find(request)
        if key is None:
            return self._not_found(sid)
        wait_s = self._rate.take(key, self.gw.now())
        if wait_s > 0:
            lim = self.gw.cfg.limits
            return error_response(
                429,
                f"session {shown(sid, 100)} posts tool events faster than"
                f" limits.session_events_per_s ({lim.session_events_per_s:g}/s,"
                f" burst {lim.session_events_burst})",
                code="session_event_rate",
                headers={"Retry-After": str(EventRate.retry_after_s(wait_s))},
            )
        try:
            raw = await read_limited(request, self.gw.cfg.server.max_body_bytes)
            body = ToolEventBody.model_validate_json(raw)
        except BodyError as exc:
            return error_response(exc.status, exc.message, code=exc.code)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "body"
            return _bad(f"{field}: {err['msg']}", code="invalid_event")
        tel, tools = self.gw.telemetry, self.gw.cfg.tools
        now = tel.wall()
        ts = now if body.ts is None else body.ts
        if ts > now + tools.tuning.event_max_future_s:
            return _bad(f"ts: {ts} is {ts - now:.1f} s in the future", code="invalid_event")
        if ts < now - tools.tuning.event_max_age_s:
            return _bad(
                f"ts: {ts} is older than {tools.tuning.event_max_age_s:g} s", code="invalid_event"
            )
        if self.gw.sessions.get(key) is None:  # ended while its body was on the way
            return self._not_found(sid)
        events = tel.tracker.explicit_event(key, body.type, body.tool, ts, body.queue_wait_s)
        tel.publish_tools(events)
        return web.json_response(
            {
                "session": sid,
                "accepted": body.type,
                "published": [e.type for e in events],
                "tools_in_flight": tel.tracker.in_flight,
            },
            status=202,
        )

    async def delete_session(self, request: web.Request) -> web.Response:
        refused = _query_names(request, frozenset())
        if refused is not None:
            return refused
        sid, key = self._find(request)
        if key is None or not self.gw.sessions.end(key, self.gw.now()):
            # Not known here: it may live on another replica sharing the admission store.
            adm = self.gw.admission
            if adm is None or not await adm.end_elsewhere(keys_for(_tenant(request), sid)[0]):
                return self._not_found(sid)
        return web.json_response({"session": sid, "ended": True})

    async def state(self, request: web.Request) -> web.Response:
        q = request.query
        try:
            check_names((k for k, _ in q.items()), STATE_QUERY)
            details = flag(q, "sessions")
            limit = integer(q, "limit", 100, 1, MAX_PAGE)
            offset = integer(q, "offset", 0, 0, MAX_OFFSET)
        except QueryError as exc:
            return _bad_query(exc)
        doc = build_state(self.gw, details=details, limit=limit, offset=offset)
        return web.json_response(doc, headers={"Cache-Control": "no-store"})

    async def events(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        try:
            check_names((k for k, _ in q.items()), EVENTS_QUERY)
            flush_ms = integer(q, "flush_ms", 0, 0, MAX_FLUSH_MS)
        except QueryError as exc:
            return _bad_query(exc)
        fmt_raw = q.get("format", "sse")
        if fmt_raw not in ("sse", "ndjson"):
            return _bad(f"format: must be sse or ndjson, got {shown(fmt_raw)}", param="format")
        fmt: StreamFormat = "ndjson" if fmt_raw == "ndjson" else "sse"
        try:
            types = parse_types(q.get("type"))
        except FilterError as exc:
            return _bad(f"{exc.param}: {exc}", param=exc.param)
        session = q.get("session") or None
        resp = web.StreamResponse(
            headers={
                "Content-Type": CONTENT_TYPE[fmt],
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # nginx: do not buffer a live stream
            }
        )
        sub = self.gw.telemetry.bus.subscribe(event_filter(types, session, unscoped_id))
        keepalive = self.gw.cfg.telemetry.sse_keepalive_s
        try:
            await resp.prepare(request)
            delivered = await self._pump(resp, sub, fmt, flush_ms, keepalive)
            if delivered:  # shutdown: end the stream cleanly
                delivered = await self._write(resp.write_eof(), keepalive)
            if not delivered:
                # What is queued for a reader that takes nothing cannot leave: drop its
                # connection rather than hold it (and the proxy's shutdown) for it.
                log.warning("event stream to %s cut off: its reader took nothing %s",
                            request.remote, "at shutdown" if self._closing.is_set()
                            else f"for telemetry.sse_keepalive_s ({keepalive:g} s)")
                if request.transport is not None:
                    request.transport.abort()
        except ConnectionError:
            pass  # the client went away; the subscription closes below
        finally:
            sub.close()
        return resp

    async def _pump(self, resp: web.StreamResponse, sub: Subscription, fmt: StreamFormat,
                    flush_ms: int, keepalive: float) -> bool:
        """Events and keep-alives to the reader until shutdown (True), or until a write waits
        longer than a keep-alive interval (False)."""
        # headers and a first byte out at once
        if not await self._write(resp.write(KEEPALIVE[fmt]), keepalive):
            return False
        while not self._closing.is_set():
            batch = await self._next(sub, keepalive)
            data = self._encoder.encode(batch, fmt) if batch else KEEPALIVE[fmt]
            if not await self._write(resp.write(data), keepalive):
                return False
            if batch and flush_ms:
                # Let events gather: one write per interval instead of one per event.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), flush_ms / 1000)
        return True

    async def _write(self, write: Awaitable[None], within_s: float) -> bool:
        """Await one write to an event stream; False when it took longer than ``within_s``
        (it blocks only while the reader takes nothing) or the proxy began to stop."""
        try:
            async with asyncio.timeout(0 if self._closing.is_set() else within_s) as t:
                self._writes.add(t)
                try:
                    await write
                finally:
                    self._writes.discard(t)
        except TimeoutError:
            return False
        return True

    async def _next(self, sub: Subscription, wait_s: float) -> list[Event]:
        """The next batch, or [] after ``wait_s`` (time for a keep-alive) or at shutdown."""
        ready = sub.poll()
        if ready:  # under load events are usually waiting: no tasks to create
            return ready
        getter = asyncio.ensure_future(sub.get_batch())
        closer = asyncio.ensure_future(self._closing.wait())
        try:
            done, _ = await asyncio.wait(
                {getter, closer}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
            )
            return getter.result() if getter in done else []
        finally:
            for t in (getter, closer):
                if not t.done():
                    t.cancel()
