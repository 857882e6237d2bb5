"""The aiohttp application of the gateway, and ``serve`` with graceful shutdown.

The app asks its server for ``handler_cancellation``: a client that disconnects cancels its
handler at once, which closes the upstream connection and so aborts the worker's request even
while the worker is silent (prefill, queueing).

One middleware does, outermost first: errors (every error the proxy answers is OpenAI-shaped,
aiohttp's own 404/405/413 included, and an unexpected exception is a logged 500, never a
crash), the request-head cap, the admin token, the body deadline, and the overhead header.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from prometheus_client import CONTENT_TYPE_LATEST

from marsproxy.config import ConfigError, MarsConfig
from marsproxy.core.identity import Route
from marsproxy.gateway.admin.admin import Admin
from marsproxy.gateway.admin.state import build_state
from marsproxy.gateway.admin.ui import UiRoutes
from marsproxy.gateway.http.auth import AdminAuth
from marsproxy.gateway.http.bodies import SCHEDULED_ROUTES, BodyError
from marsproxy.gateway.http.errors import error_response
from marsproxy.gateway.http.limits import (
    ROUTE_ARGS,
    BodyDeadline,
    GuardedSite,
    dot_segments,
    head_too_large,
    parser_args,
)
from marsproxy.gateway.http.relay import OVERHEAD_HEADER, Relay
from marsproxy.gateway.http.routes import PassthroughGate
from marsproxy.gateway.shells.service import Gateway
from marsproxy.telemetry.prometheus import StateCollector

log = logging.getLogger("marsproxy.gateway")

GATEWAY_KEY = web.AppKey("marsproxy_gateway", Gateway)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _front(cfg: MarsConfig, gw: Gateway) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The one middleware; one coroutine layer instead of three (each layer costs on every
    request). In order: errors, the request-head cap, the admin token, the body deadline, and
    the overhead header."""
    auth = AdminAuth(cfg.auth)
    limits = cfg.limits
    refused_total = gw.metrics.refused

    @web.middleware
    async def front(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            refused = (
                head_too_large(request, limits.max_header_bytes)
                or dot_segments(request)
                or auth.check(request)
            )
            if refused is not None:
                if request.body_exists:
                    refused.force_close()  # its body is never read
                refused_total.labels(str(refused.status)).inc()
                return refused
            t0 = time.perf_counter()
            if not request.body_exists or request.content.is_eof():
                # No body, or all of it arrived with the head: no deadline to watch.
                resp = await handler(request)
            else:
                deadline = BodyDeadline(request, limits.body_timeout_s)
                try:
                    resp = await handler(request)
                finally:
                    deadline.cancel()
                if deadline.expired:
                    resp.force_close()  # the rest of the body may still be on its way
            # The admin endpoints' overhead header (the relay sets its own, without upstream
            # time).
            if OVERHEAD_HEADER not in resp.headers and not resp.prepared:
                resp.headers[OVERHEAD_HEADER] = f"{(time.perf_counter() - t0) * 1000:.3f}"
            return resp
        except web.HTTPException as exc:
            # aiohttp's own errors (no route, wrong method, body over client_max_size).
            if exc.status < 400:
                raise
            refused_total.labels(str(exc.status)).inc()
            code = "body_too_large" if exc.status == 413 else exc.reason.lower().replace(" ", "_")
            headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
            return error_response(
                exc.status, f"{request.method} {request.path}: {exc.reason}", code=code,
                headers=headers,
            )
        except BodyError as exc:
            refused_total.labels(str(exc.status)).inc()
            return error_response(exc.status, f"{request.path}: {exc.message}", code=exc.code)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:  # what a handler did not expect: a logged 500, never a crash
            log.exception("unexpected error on %s %s", request.method, request.path)
            return error_response(
                500, f"internal error of the proxy on {request.path}", code="internal_error"
            )

    return front


class AccessLog(AbstractAccessLogger):
    """One line per request; the path without its query (which may carry a key), no headers."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.info(
            "%s %s %s %d %dB %.3fs",
            request.remote, request.method, request.path, response.status,
            response.body_length, time,
        )


def create_app(cfg: MarsConfig) -> web.Application:
    """The gateway app; its health checker and upstream pool start on startup, stop on cleanup.

    ``app[GATEWAY_KEY].stats()`` gives requests per worker and session → worker assignments.
    """
    gw = Gateway(cfg)
    relay = Relay(gw)
    # Body size is enforced by the relay (to answer 413 in the OpenAI shape); aiohttp's own
    # limit only has to stay out of the way.
    # handler_cancellation travels with the app, so any runner (tests, demo) cancels the
    # handler of a client that disconnects, which aborts the worker's request at once.
    app = web.Application(
        client_max_size=cfg.server.max_body_bytes + 1,
        handler_args={"handler_cancellation": True, **parser_args(cfg.limits)},
        middlewares=[_front(cfg, gw)],
    )
    app[GATEWAY_KEY] = gw
    # Pressure gauges are read from the state document at scrape time, not kept up to date.
    StateCollector(lambda: build_state(gw)).register(gw.metrics.registry)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        healthy = gw.healthy()
        if healthy:
            return web.json_response({"status": "ready", "healthy_workers": len(healthy)})
        return error_response(
            503, "no healthy worker", code="no_healthy_worker", headers={"Retry-After": "1"}
        )

    async def metrics(_: web.Request) -> web.Response:  # behind the token if auth.protect_metrics
        return web.Response(body=gw.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def scheduled(route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await relay.scheduled(request, route)

        return handler

    app.router.add_get("/healthz", healthz, **ROUTE_ARGS)
    app.router.add_get("/readyz", readyz, **ROUTE_ARGS)
    app.router.add_get("/metrics", metrics, **ROUTE_ARGS)
    UiRoutes().add_routes(app)  # before the admin API's catch-all under /mars/
    Admin(gw).add_routes(app)
    for path, route in SCHEDULED_ROUTES.items():
        app.router.add_post(path, scheduled(route), **ROUTE_ARGS)
    # Only the inference API passes by default (routes.py); the rest is refused here.
    gate = PassthroughGate(AdminAuth(cfg.auth), cfg.auth.passthrough_routes, gw.metrics.refused)
    app.router.add_route("*", "/{tail:.*}", gate.wrap(relay.passthrough), **ROUTE_ARGS)

    async def close_after_bad_body(request: web.Request, resp: web.StreamResponse) -> None:
        # A body that did not decode (Content-Encoding, chunking), read or not: the bytes after
        # it cannot be framed, so the connection ends with this response (Connection: close)
        # instead of failing the client's next request on it.
        if request.content.exception() is not None:
            resp.force_close()
            resp.headers["Connection"] = "close"  # the hook runs after aiohttp's own choice

    app.on_response_prepare.append(close_after_bad_body)

    async def on_startup(_: web.Application) -> None:
        await gw.start()

    async def on_shutdown(_: web.Application) -> None:
        # Before the drain: requests still waiting for admission would only run out the clock.
        if gw.admission is not None:
            gw.admission.shutting_down()

    async def on_cleanup(_: web.Application) -> None:
        await gw.stop()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


@dataclass
class Running:
    """A started gateway: its runner, the port it got, and its state."""

    runner: web.AppRunner
    port: int
    gateway: Gateway
    site: GuardedSite

    async def stop(self) -> None:
        await self.runner.cleanup()


def os_reason(exc: OSError) -> str:
    """The reason alone ("Address already in use"), without the errno and address."""
    return os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror or str(exc)


async def start(cfg: MarsConfig, app: web.Application | None = None) -> Running:
    """Listen on ``cfg.server.host:port`` (port 0: any free one) and return at once; a
    :class:`ConfigError` when that address cannot be listened on."""
    app = app if app is not None else create_app(cfg)
    runner = web.AppRunner(
        app,
        shutdown_timeout=cfg.server.drain_timeout_s,
        access_log=logging.getLogger("marsproxy.access") if cfg.server.access_log else None,
        access_log_class=AccessLog,
    )
    await runner.setup()
    refused_total = app[GATEWAY_KEY].metrics.refused
    site = GuardedSite(runner, cfg.server.host, cfg.server.port, cfg.limits,
                       on_refused=lambda status: refused_total.labels(str(status)).inc())
    try:
        await site.start()
    except OSError as exc:  # a port taken, a host that is not this machine's
        await runner.cleanup()  # the gateway had started: close its client sessions
        raise ConfigError(f"cannot listen on {cfg.server.host}:{cfg.server.port}"
                          f" (server.host, server.port): {os_reason(exc)}") from None
    port = cfg.server.port
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            port = int(addr[1])
            break
    return Running(runner, port, app[GATEWAY_KEY], site)


async def serve(cfg: MarsConfig) -> None:
    """Run until SIGTERM/SIGINT; then stop accepting, drain in-flight requests, exit.

    In-flight requests (streams included) get up to ``server.drain_timeout_s`` to finish;
    whatever is still running then is cancelled, which closes its upstream connection.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    running = await start(cfg)
    # What exists now (modules, config, the app) lives as long as the process: frozen out of
    # the garbage collector's full collections, which then walk only what requests created
    # (half the objects, half the pause, with a full event ring).
    gc.freeze()
    log.info(
        "marsproxy listening on %s:%d, workers: %s",
        cfg.server.host,
        running.port,
        ", ".join(w.label for w in cfg.workers),
    )
    try:
        await stop.wait()
        log.info(
            "shutting down: draining in-flight requests for up to %.1f s",
            cfg.server.drain_timeout_s,
        )
    finally:
        await running.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.remove_signal_handler(sig)
    log.info("marsproxy stopped")
