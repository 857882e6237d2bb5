"""The admin token: which paths need it, and a constant-time check of the bearer credential.

Operator endpoints (everything under ``/mars/`` but the tenant-scoped session endpoints, and
``/metrics`` when ``auth.protect_metrics``) need ``Authorization: Bearer <auth.admin_token>``
once a token is configured. Session endpoints (``/mars/v1/sessions/...``) are authorized by the
caller's own API key instead: they only ever reach that key's sessions (see ``admin.py``), so
agents need no operator secret. ``/healthz`` and ``/readyz`` stay open for probes, and so do
the live page's static files (``/mars/ui``, ``ui.py``): they hold no data, and the page asks for
the token before it reads any. The same token lets a request through to the workers' routes
beyond the inference API (``routes.py``).
"""

from __future__ import annotations

import hmac

from aiohttp import web

from marsproxy.gateway.http.errors import error_response
from marsproxy.security_config import AuthConfig

SESSION_PREFIX = "/mars/v1/sessions/"
UI_PATH = "/mars/ui"


class AdminAuth:
    def __init__(self, cfg: AuthConfig) -> None:
        self._token = cfg.admin_token.get_secret_value().encode()
        self._metrics = cfg.protect_metrics

    @property
    def enabled(self) -> bool:
        return bool(self._token)

    def protects(self, path: str) -> bool:
        if not self._token:
            return False
        if path.startswith("/mars/"):
            return not (path.startswith(SESSION_PREFIX) or path == UI_PATH
                        or path.startswith(UI_PATH + "/"))
        return self._metrics and path == "/metrics"

    def allows(self, authorization: str | None) -> bool:
        """Whether the header carries the token; the comparison takes the same time for any
        credential of the same length, so response times do not leak the token."""
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), self._token)

    def check(self, request: web.Request) -> web.Response | None:
        """None when the request may go on; else the 401 it gets."""
        if not self.protects(request.path) or self.allows(request.headers.get("Authorization")):
            return None
        return error_response(
            401,
            f"{request.path} needs the admin token: Authorization: Bearer <auth.admin_token>",
            code="invalid_admin_token",
            headers={"WWW-Authenticate": 'Bearer realm="marsproxy-admin"'},
        )
