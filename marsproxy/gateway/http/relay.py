"""The request handlers: scheduled routes (session → worker, usage, SSE relay) and pass-through.

Each handler keeps a ``Clock`` so the ``x-marsproxy-overhead-ms`` header reports the time spent
in the proxy until the response leaves, less the wait for the worker and for an admission or
dispatch slot. The work after the response (metrics, ``llm_end``, the session table, the end of
a final session) runs right after it has left, without waiting on anything (with the in-memory
store), so the client does not wait for it; ``marsproxy_proxy_overhead_seconds`` counts it too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from marsproxy.config import WorkerConfig
from marsproxy.core.identity import (
    BadFinalFlag,
    Route,
    UnknownClass,
    explicit_session_id,
    history_of,
    is_final,
    previous_response_id,
    session_class,
    tenant_of,
    tree_identity,
)
from marsproxy.core.sessions import Turn
from marsproxy.gateway.http.bodies import BodyError, parse_body, read_limited, set_key
from marsproxy.gateway.http.call_end import CallEnd
from marsproxy.gateway.http.relay_response import CLIENT_GONE, buffered, done, stream
from marsproxy.gateway.http.reply_kind import offers_tools
from marsproxy.gateway.http.routes import stored_response_id
from marsproxy.gateway.http.upstream import (
    Opened,
    Picker,
    UpstreamFailure,
    credentials,
    request_headers,
    response_headers,
)
from marsproxy.gateway.shells.admission_types import Refused
from marsproxy.gateway.shells.kv_events import sets_session_id
from marsproxy.gateway.shells.outcome import OVERHEAD_HEADER as OVERHEAD_HEADER
from marsproxy.gateway.shells.outcome import Clock, Outcome, RequestEvents, error
from marsproxy.gateway.shells.replicas import ReplyLink
from marsproxy.gateway.shells.scheduler import Prepared, Rerouted
from marsproxy.gateway.shells.service import Gateway
from marsproxy.gateway.shells.sessions import SessionRefused

log = logging.getLogger("marsproxy.gateway.http.relay")

class Relay:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._retry_after = max(1, round(gw.cfg.health.interval_s))
        self.events = RequestEvents(gw)
        self.ends = CallEnd(gw, self.events)
        self._session_ids = sets_session_id(gw.cfg)

    async def scheduled(self, request: web.Request, route: Route) -> web.StreamResponse:
        gw, clock, out = self.gw, Clock(), Outcome(route, scheduled=True)
        gw.metrics.in_flight.inc()
        resp: web.StreamResponse | None = None
        try:
            resp = await self._scheduled(request, route, clock, out)
            if not resp.prepared:
                await self._send(request, resp, clock, out)
            return resp
        except asyncio.CancelledError:
            out.status = CLIENT_GONE
            raise
        finally:
            clock.tail_begins()
            self._after(route, out, clock, resp)

    def _after(self, route: Route, out: Outcome, clock: Clock,
               resp: web.StreamResponse | None) -> None:
        """The work after the response. The call's and the session's end (which releases the
        session's slot) run even when the accounting before them fails: a bug there costs
        a log line and a counter, never a slot held for good."""
        try:
            self.ends.read(route, out)
            self._account(out, clock)
        except Exception:
            log.exception("accounting of a %s request of session %s failed; its call ends "
                          "anyway", route, out.session)
        try:
            self.ends.close(route, out, clock)  # now, or when a background response ends
            self._observe(out, clock, resp)
        except Exception:
            log.exception("the end of a %s call of session %s failed", route, out.session)

    @staticmethod
    async def _send(
        request: web.Request, resp: web.StreamResponse, clock: Clock, out: Outcome
    ) -> None:
        """A response with a body leaves before the after-work (the call's and the session's
        end, the release, the accounting), as a stream's last chunk does: the client does not
        wait for it. The header says the proxy's time up to here; the histogram adds the rest."""
        resp.headers.update(clock.header())
        try:
            await resp.prepare(request)
            await resp.write_eof()
        except ConnectionResetError:  # the client left: nothing to send it
            out.status = CLIENT_GONE

    async def _scheduled(
        self, request: web.Request, route: Route, clock: Clock, out: Outcome
    ) -> web.StreamResponse:
        gw, cfg = self.gw, self.gw.cfg
        try:
            raw = await read_limited(request, cfg.server.max_body_bytes)
            body = parse_body(route, raw)
        except BodyError as exc:
            return error(clock, out, exc.status, exc.code, f"{request.path}: {exc.message}")
        # Anthropic-style clients send their key as x-api-key instead of Authorization.
        tenant = tenant_of(request.headers.get("Authorization") or request.headers.get("x-api-key"))
        classes = cfg.admission.classes
        try:
            cls = session_class(request.headers, order=classes.order, default=classes.default,
                                tenant_class=classes.by_tenant.get(tenant))
            final = is_final(request.headers, cfg.sessions.final_headers)
        except UnknownClass as exc:
            return error(clock, out, 400, "unknown_session_class", str(exc))
        except BadFinalFlag as exc:  # before any session state or slot is taken
            return error(clock, out, 400, "invalid_final_flag", str(exc))
        explicit = explicit_session_id(
            request.headers,
            body.obj,
            header_names=cfg.sessions.headers,
            body_fields=cfg.sessions.body_fields,
        )
        explicit, parent = tree_identity(
            request.headers, explicit, subagent_headers=cfg.sessions.subagent_headers,
            parent_headers=cfg.sessions.parent_headers,
            live=lambda sid: gw.sessions.get(f"{tenant}/id/{sid}") is not None)
        history = (history_of(route, body.obj)
                   if explicit is None and cfg.sessions.chain_matching else None)
        prev = None if explicit else previous_response_id(route, body.obj)
        found = None if prev is None else await gw.replies.find(tenant, prev, request.headers)
        try:
            turn = gw.sessions.start(
                tenant=tenant, explicit_id=explicit.value if explicit else None,
                explicit_source=explicit.source if explicit else "header",
                history=history, final=final, now=gw.now(), previous_response=prev,
                linked_key=None if found is None else found.key)
        except SessionRefused as exc:  # bad session id, or the tenant's session cap
            return error(clock, out, exc.status, exc.code, exc.message)
        out.session, out.turn_ref = turn.session, turn
        out.offers_tools = offers_tools(body.obj)
        out.stores = body.obj.get("store") is not False  # else no later request can name its id
        if route == "responses" and body.obj.get("background") is True:
            out.credentials = credentials(request.headers)  # to poll the worker for its end
        if self._session_ids:  # the workers' KV events name the session (docs/kv-events.md)
            body.raw = set_key(body.raw, body.obj, "session_id", turn.session)
        out.turn = gw.request_arrived(turn)
        ids = await self._token_ids(route, body.obj, turn.session)
        # No healthy worker at all: nothing to wait for; the upstream step answers 503 at once.
        if gw.healthy():
            prefix = None if gw.kv_use is None else gw.kv_use.prefix(ids)
            parent_key = None if parent is None else f"{tenant}/id/{parent}"
            refused = await self._admit(turn, tenant, raw, final, clock, out, cls, prefix,
                                        parent_key, gw.replies.link(turn, found))
            if refused is not None:
                return refused
        strip = body.stream and body.strip_usage_chunk
        prepared = await self._schedule(turn, route, body.obj, body.raw, clock, out, ids)
        return await self._relay(request, route, prepared, strip, turn, clock, out)

    async def _token_ids(self, route: Route, obj: dict[str, Any], key: str) -> list[int] | None:
        """The prompt's token ids while some worker's KV index can use them (kv_use.py)."""
        kv = self.gw.kv_use
        if kv is None or not kv.active():
            return None
        placed = self.gw.placement.worker_of(key)
        return await kv.token_ids(route, obj, None if placed is None
                                  else self.gw.workers[placed].label)

    async def _schedule(
        self, turn: Turn, route: Route, obj: dict[str, Any], raw: bytes, clock: Clock,
        out: Outcome, ids: list[int] | None = None,
    ) -> Prepared:
        """The scheduler: level, a wait in the worker's gated queue if its gate is closed,
        then the body and hint headers that go upstream. ``ids``: the prompt's token ids
        (KV events: its resident prefix there, and the prediction of its cached tokens)."""
        gw, kv, again = self.gw, self.gw.kv_use, False
        while True:  # again when its worker is ejected while it waits in that worker's gate
            url = gw.placement.assign(turn.session, gw.healthy())
            if url is None:  # no healthy worker: the upstream step answers 503 at once
                return Prepared(None, raw, {}, "none")
            label = gw.workers[url].label
            resident = None if kv is None else kv.resident(label, ids)
            t = time.perf_counter()
            try:  # vLLM reads no `priority` on /v1/messages: those calls are ordered by the gate
                out.prepared = await gw.scheduler.prepare(
                    turn.session, url, obj, raw, body_priority=route != "messages",
                    resident_tokens=resident, again=again)
                break
            except BaseException as exc:  # the client left while held, or it was rerouted
                clock.held_s += time.perf_counter() - t
                if not isinstance(exc, Rerouted):
                    raise
                again = True
        ticket = out.prepared.ticket
        if ticket is not None:  # held: the wait in the gated queue; the rest is the proxy's
            clock.held_s += min(time.perf_counter() - t, ticket.waited_s())
        if kv is not None:  # just before dispatch: what the engine should find cached
            out.kv_prediction = kv.predict(label, ids)
        return out.prepared

    async def _admit(
        self, turn: Turn, tenant: str, raw: bytes, final: bool, clock: Clock, out: Outcome,
        cls: str, prefix: dict[str, int] | None, parent: str | None, reply: ReplyLink | None,
    ) -> web.Response | None:
        """Admission: go on (None), after waiting if the window is full, or the refusal."""
        gw = self.gw
        t, chars = time.perf_counter(), len(raw)
        try:
            verdict = await gw.admit(turn.session, tenant, chars, final, raw, cls=cls,
                                     prefix=prefix, parent=parent, reply=reply)
        except BaseException:  # the client left while its request was held
            clock.held_s += time.perf_counter() - t
            raise
        # Held: the wait in the admission queue; admitted at once, admission's work is the
        # proxy's own (store round trips included). A refusal may have waited: all held.
        spent = time.perf_counter() - t
        clock.held_s += spent if isinstance(verdict, Refused) else min(spent, verdict.waited_s)
        if isinstance(verdict, Refused):
            return error(clock, out, verdict.status, verdict.code, verdict.message,
                         verdict.retry_after_s)
        out.admitted, out.prompt_chars, out.incarnation = True, chars, verdict.incarnation
        gw.admitted_to(turn.session, verdict.worker)
        return None

    async def _relay(
        self,
        request: web.Request,
        route: Route,
        prepared: Prepared,
        strip: bool,
        turn: Turn,
        clock: Clock,
        out: Outcome,
    ) -> web.StreamResponse:
        gw = self.gw
        headers = request_headers(request.headers, identity=True)
        for k, v in prepared.headers.items():  # scheduler hints replace any client value
            headers[k] = v

        def pick(tried: Iterable[WorkerConfig]) -> WorkerConfig | None:
            worker = gw.pick_for_session(turn.session, tried)
            if worker is not None:
                gw.scheduler.moved(prepared, worker.url)
            return worker

        opened = await self._open(request, headers, prepared.raw, pick, clock, out)
        if not isinstance(opened, Opened):
            return opened
        upstream = opened.response
        completed = False
        try:
            is_sse = upstream.content_type == "text/event-stream"
            if upstream.status < 400 and is_sse:
                resp = await stream(
                    gw, self.events, request, route, opened, strip, turn, clock, out
                )
            else:
                resp = await buffered(gw, self.events, route, opened, clock, out)
            completed = True
            return resp
        finally:
            done(opened, completed)

    async def _open(
        self,
        request: web.Request,
        headers: CIMultiDict[str],
        raw: bytes,
        pick: Picker,
        clock: Clock,
        out: Outcome,
    ) -> Opened | web.Response:
        """The worker's response headers, or the error response the client gets instead."""
        try:
            opened = await self.gw.upstream.open(
                request.method, request.path_qs, headers, raw, self.events.picker(out, pick)
            )
        except UpstreamFailure as exc:
            clock.upstream_s += exc.upstream_s
            retry = self._retry_after if exc.status == 503 else None
            return error(clock, out, exc.status, exc.code, exc.message, retry)
        clock.upstream_s += opened.upstream_s
        return opened
    # -- everything else --------------------------------------------------------------------------

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        gw, clock, out = self.gw, Clock(), Outcome("passthrough", scheduled=False)
        gw.metrics.in_flight.inc()
        resp: web.StreamResponse | None = None
        try:
            resp = await self._passthrough(request, clock, out)
            return resp
        except asyncio.CancelledError:
            out.status = CLIENT_GONE
            raise
        finally:
            clock.tail_begins()
            self._account(out, clock)
            self.events.ended(out, clock)
            self._observe(out, clock, resp)

    async def _passthrough(
        self, request: web.Request, clock: Clock, out: Outcome
    ) -> web.StreamResponse:
        gw = self.gw
        try:
            raw = await read_limited(request, gw.cfg.server.max_body_bytes)
        except BodyError as exc:
            return error(clock, out, exc.status, exc.code, f"{request.path}: {exc.message}")
        pick = await gw.passthrough_picker(request.path, request.headers)
        opened = await self._open(
            request, request_headers(request.headers, identity=False), raw, pick, clock, out)
        if not isinstance(opened, Opened):
            return opened
        upstream = opened.response
        completed = False
        try:
            headers = response_headers(upstream.headers)
            headers.update(clock.header())
            resp = web.StreamResponse(status=upstream.status, headers=headers)
            out.status = upstream.status
            await resp.prepare(request)
            try:
                while chunk := await opened.body.read():
                    await resp.write(chunk)
            except (TimeoutError, aiohttp.ClientError) as exc:
                gw.metrics.upstream_errors.labels(opened.worker.label, "passthrough").inc()
                log.warning(
                    "pass-through %s from %s cut: %r", request.path, opened.worker.label, exc
                )
                return resp  # the body is short; the client sees the connection end
            await resp.write_eof()
            completed = True
            if rid := stored_response_id(request.path):  # a background call may have ended
                gw.background.poke(rid)
            return resp
        finally:
            done(opened, completed)

    def _account(self, out: Outcome, clock: Clock) -> None:
        m = self.gw.metrics
        m.in_flight.dec()
        m.requests.labels(out.route, str(out.status)).inc()
        m.latency.labels(out.route).observe(time.perf_counter() - clock.t0)

    def _observe(self, out: Outcome, clock: Clock, resp: web.StreamResponse | None) -> None:
        """Last: the proxy's whole time, into the histogram and (not sent yet) the header."""
        self.gw.metrics.overhead.labels(out.route).observe(clock.stamp(resp))
