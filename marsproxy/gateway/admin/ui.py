"""``GET /mars/ui``: the live page, static files packaged in ``marsproxy/gateway/ui_static``.

The page holds no data of its own: it reads ``/mars/v1/state`` and ``/mars/v1/events`` from the
browser, with the admin token (asked once, kept in the tab's sessionStorage, sent as an
``Authorization`` header, never in a URL). So the files themselves are served without the token
(``auth.py``), and the page can ask for it. The files are read once, at start-up, into memory;
names outside the packaged set are 404, so no path reaches the file system.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from aiohttp import web

from marsproxy.gateway.http.auth import UI_PATH
from marsproxy.gateway.http.errors import error_response
from marsproxy.gateway.http.limits import ROUTE_ARGS

ASSET_PACKAGE = "marsproxy.gateway"
ASSET_DIR = "ui_static"
CONTENT_TYPES = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
    ".txt": "text/plain",
}
# Scripts and styles from this origin only (no inline script, no CDN); connections to the
# proxy itself; the page may not be framed by another site.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
        " connect-src 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str


def content_type(name: str) -> str | None:
    """The type a packaged file is served with, by its extension; None: not served."""
    dot = name.rfind(".")
    return None if dot < 0 else CONTENT_TYPES.get(name[dot:])


def load_assets() -> dict[str, Asset]:
    """Every servable file of the packaged directory, by name (flat: no subdirectories)."""
    out: dict[str, Asset] = {}
    for entry in resources.files(ASSET_PACKAGE).joinpath(ASSET_DIR).iterdir():
        ctype = content_type(entry.name)
        if ctype is not None and entry.is_file():
            out[entry.name] = Asset(entry.read_bytes(), ctype)
    return out


def asset_name(path: str) -> str | None:
    """``/mars/ui`` and ``/mars/ui/`` → ``index.html``; ``/mars/ui/<name>`` → ``<name>``;
    anything else (another prefix, a nested path) → None."""
    if path in (UI_PATH, UI_PATH + "/"):
        return "index.html"
    if not path.startswith(UI_PATH + "/"):
        return None
    name = path[len(UI_PATH) + 1 :]
    return name if name and "/" not in name else None


class UiRoutes:
    def __init__(self) -> None:
        self.assets = load_assets()

    def add_routes(self, app: web.Application) -> None:
        # Before the admin API's catch-all under /mars/: routes match in order.
        app.router.add_get(UI_PATH, self.serve, allow_head=False, **ROUTE_ARGS)
        app.router.add_get(UI_PATH + "/{name:.*}", self.serve, allow_head=False, **ROUTE_ARGS)

    async def serve(self, request: web.Request) -> web.Response:
        name = asset_name(request.path)
        asset = None if name is None else self.assets.get(name)
        if asset is None:
            return error_response(
                404, f"no file {request.path} in the UI", code="not_found"
            )
        resp = web.Response(body=asset.body, headers=SECURITY_HEADERS)
        resp.content_type = asset.content_type
        resp.charset = "utf-8"
        return resp
