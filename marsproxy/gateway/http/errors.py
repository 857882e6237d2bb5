"""The one error shape of the proxy: OpenAI's ``{"error": {"message", "type", "param", "code"}}``
(``param`` names the query parameter at fault where there is one; null otherwise: the error is
about the request as a whole or its headers)."""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

log = logging.getLogger("marsproxy.gateway")

REASON_HEADER = "x-marsproxy-reason"
"""Every error response names its reason here: the error body's ``code``, machine-readable."""

# status → OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    417: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_body(
    message: str, *, status: int, code: str, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    *,
    code: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> web.Response:
    """An OpenAI-shaped error, its code also in ``x-marsproxy-reason``; every one is logged
    once, saying what was wrong."""
    log.warning("%d %s: %s", status, code, message)
    return web.Response(
        status=status,
        body=json.dumps(error_body(message, status=status, code=code, param=param)).encode(),
        content_type="application/json",
        headers={REASON_HEADER: code, **(headers or {})},
    )


def sse_error_event(message: str, *, code: str, status: int = 504) -> bytes:
    """How a stream that already started says it failed: a final ``data:`` event."""
    log.warning("stream cut (%s): %s", code, message)
    return b"data: " + json.dumps(error_body(message, status=status, code=code)).encode() + b"\n\n"
