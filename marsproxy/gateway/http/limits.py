"""The caps on what clients may send, enforced before a request reaches a handler.

- Connections: :class:`GuardedSite` listens like ``web.TCPSite`` but counts connections; one
  over ``limits.max_connections`` gets a 429 and is closed without reaching aiohttp.
- Request heads: aiohttp's parser limits follow ``limits.max_header_bytes`` and
  ``max_header_count``; what the parser refuses gets an OpenAI-shaped 400/431 from
  :class:`GuardedHandler` (aiohttp's own answer is plain text and logs the offending line, which
  may hold a credential). :func:`head_too_large` checks the total size of a parsed head.
- Slow clients: the head must arrive within ``limits.header_timeout_s`` (aiohttp's keep-alive
  timer, which also runs from connect); :class:`BodyDeadline` fails a body still arriving after
  ``limits.body_timeout_s`` with a 408.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler

from marsproxy.gateway.http.bodies import BodyError
from marsproxy.gateway.http.errors import error_body, error_response
from marsproxy.redact import redact
from marsproxy.security_config import LimitsConfig

log = logging.getLogger("marsproxy.gateway.http.limits")


def parser_args(limits: LimitsConfig) -> dict[str, Any]:
    """Keyword arguments of aiohttp's request handler that bound the request head."""
    return {
        "max_line_size": limits.max_header_bytes,
        "max_field_size": limits.max_header_bytes,
        "max_headers": limits.max_header_count,
        "keepalive_timeout": limits.header_timeout_s,
    }


def head_too_large(request: web.Request, max_bytes: int) -> web.Response | None:
    """431 when the request line and headers together exceed ``max_bytes``."""
    size = len(request.method) + len(request.raw_path) + 12  # "GET /p HTTP/1.1\r\n"
    for name, value in request.raw_headers:
        size += len(name) + len(value) + 4  # ": " and CRLF
    if size <= max_bytes:
        return None
    return error_response(
        431,
        f"request head of {size} bytes exceeds limits.max_header_bytes ({max_bytes})",
        code="header_too_large",
    )


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """Every route's ``Expect`` handler: aiohttp's (100 Continue), but an unknown expectation
    gets an OpenAI-shaped 417 instead of a plain-text one."""
    expect = request.headers.get("Expect", "")
    if request.version != (1, 1):
        return None
    if expect.lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper has not started
        return None
    resp = error_response(417, "only Expect: 100-continue is supported", code="expectation_failed")
    resp.force_close()  # the body, if any, is not read
    return resp


ROUTE_ARGS: dict[str, Any] = {"expect_handler": expect_continue}
"""Keyword arguments for every ``router.add_*`` call of the gateway."""


def dot_segments(request: web.Request) -> web.Response | None:
    """400 for a path with ``.``/``..`` segments (``%2e`` too): the router and a worker could
    disagree on where it leads. Session ids keep their slashes percent-encoded (``a%2Fb``),
    so an id like ``../x`` is still one segment and allowed."""
    path = request.raw_path.split("?", 1)[0]
    if "." not in path and "%" not in path:  # the common case, without splitting
        return None
    for segment in path.split("/"):
        if segment and unquote(segment) in (".", ".."):
            return error_response(
                400, "request path contains a '.' or '..' segment", code="invalid_path"
            )
    return None


# -- connections ----------------------------------------------------------------------------


class Connections:
    """How many client connections are open; shared by the site's handlers."""

    def __init__(self, limit: int, on_refused: Callable[[int], None] | None = None) -> None:
        self.limit = limit
        self.open = 0
        # Told the status of every refusal made below aiohttp's handlers (the connection cap,
        # unparsable heads): the gateway's metrics count them.
        self.on_refused: Callable[[int], None] = on_refused or (lambda _status: None)


def _raw_response(status: int, reason: str, code: str, message: str, retry_after: int) -> bytes:
    body = json.dumps(error_body(message, status=status, code=code)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: {retry_after}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class _Refusal(asyncio.Protocol):
    """A connection over the cap: answer 429 at once, read and drop what the client sends, and
    close when it is done or after ``linger_s`` (closing while it still sends would reset the
    connection before it reads the answer)."""

    def __init__(self, answer: bytes, linger_s: float) -> None:
        self._answer, self._linger_s = answer, linger_s
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.write(self._answer)
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(self._linger_s, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not served; its bytes are dropped

    def eof_received(self) -> bool:
        return False  # close

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


class GuardedHandler(RequestHandler):
    """aiohttp's connection handler, counted, with OpenAI-shaped answers to unparsable heads."""

    __slots__ = ("_conns", "_counted")

    def __init__(self, manager: web.Server, conns: Connections, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._conns = conns
        self._counted = True
        conns.open += 1

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self._counted = False
            self._conns.open -= 1
        super().connection_lost(exc)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # Same contract as aiohttp's: always closes the connection; nothing to send once a
        # response has started. Unlike it, the log line never carries the raw request bytes.
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        status, code, text = _classify(status, exc)
        self._conns.on_refused(status)
        detail = redact(str(exc)) if exc is not None else ""
        if status >= 500:
            log.error("%d %s: %s (%s)", status, code, text, detail, exc_info=exc)
        resp = error_response(status, text, code=code)
        resp.force_close()
        return resp


def _classify(status: int, exc: BaseException | None) -> tuple[int, str, str]:
    if isinstance(exc, LineTooLong):  # the request line or one header line
        return 431, "header_too_large", (
            "a line of the request head is too long (limits.max_header_bytes)"
        )
    if isinstance(exc, BadHttpMessage) and "too many headers" in str(exc).lower():
        return 431, "too_many_headers", "too many header lines (limits.max_header_count)"
    if isinstance(exc, HttpProcessingError) or status == 400:
        reason = type(exc).__name__ if exc is not None else "BadHttpMessage"
        return 400, "bad_http_request", f"malformed HTTP request ({reason})"
    if status == 504:
        return 504, "timeout", "request handling timed out"
    return 500, "internal_error", "internal error of the proxy"


class GuardedSite(web.BaseSite):
    """``web.TCPSite`` with a connection cap: the listening socket's protocols are counted
    :class:`GuardedHandler` instances, or a :class:`_Refusal` once the cap is reached."""

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, limits: LimitsConfig,
        on_refused: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(runner)
        self._host, self._port = host, port
        self.connections = Connections(limits.max_connections, on_refused)
        self._linger_s = limits.header_timeout_s
        self._refusal = _raw_response(
            429,
            "Too Many Requests",
            "too_many_connections",
            f"the proxy already holds limits.max_connections ({limits.max_connections})"
            " client connections",
            1,
        )

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        # The handler arguments the runner gave its server (app handler_args included).
        kwargs: dict[str, Any] = dict(server._kwargs)
        loop = asyncio.get_running_loop()
        conns = self.connections

        def protocol() -> asyncio.Protocol:
            if conns.open >= conns.limit:
                conns.on_refused(429)
                log.warning(
                    "429 too_many_connections: %d open (limits.max_connections)", conns.open
                )
                return _Refusal(self._refusal, self._linger_s)
            return GuardedHandler(server, conns, loop=loop, **kwargs)

        self._server = await loop.create_server(
            protocol, self._host, self._port, backlog=self._backlog
        )


# -- slow bodies ------------------------------------------------------------------------------


class BodyDeadline:
    """Fails a request body still arriving ``timeout_s`` after the head: its reader then
    raises ``BodyError(408)``, which the handlers answer like any other body error."""

    def __init__(self, request: web.Request, timeout_s: float) -> None:
        self._request, self._timeout_s = request, timeout_s
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire)
        self.expired = False

    def _expire(self) -> None:
        content = self._request.content
        if content.is_eof():
            return
        self.expired = True
        content.set_exception(
            BodyError(
                408,
                "body_timeout",
                f"request body not received within limits.body_timeout_s ({self._timeout_s:g} s)",
            )
        )

    def cancel(self) -> None:
        self._timer.cancel()
