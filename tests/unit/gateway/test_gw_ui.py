"""The live page's files: which paths name which packaged file, what they are served with, and
that the page's own references all resolve (no CDN, nothing missing)."""

from __future__ import annotations

import re

import pytest
from aiohttp.test_utils import TestClient, TestServer
from yarl import URL

from marsproxy.config import load_config
from marsproxy.gateway.admin.ui import SECURITY_HEADERS, asset_name, content_type, load_assets
from marsproxy.gateway.http.app import create_app
from marsproxy.gateway.http.auth import AdminAuth
from marsproxy.security_config import AuthConfig


@pytest.mark.parametrize(("path", "name"), [
    ("/mars/ui", "index.html"), ("/mars/ui/", "index.html"), ("/mars/ui/app.js", "app.js"),
    ("/mars/uix", None), ("/mars/ui/a/b.js", None), ("/mars/v1/state", None),
])
def test_asset_name(path: str, name: str | None) -> None:
    assert asset_name(path) == name


def test_content_type_by_extension_only_for_served_kinds() -> None:
    assert content_type("app.js") == "text/javascript"
    assert content_type("ui.css") == "text/css"
    assert content_type("index.html") == "text/html"
    assert content_type("notes.py") is None and content_type("README") is None


def test_packaged_page_references_resolve_and_stay_local() -> None:
    assets = load_assets()
    assert {"index.html", "app.js", "api.js", "chart.js", "panels.js", "ui.css"} <= set(assets)
    html = assets["index.html"].body.decode()
    for ref in re.findall(r'(?:src|href)="([^"]+)"', html):
        assert ref == "data:," or asset_name(ref) in assets, ref
    for name, asset in assets.items():
        text = asset.body.decode()
        assert "http://" not in text and "https://" not in text, name  # no CDN
        if name.endswith(".js"):
            for mod in re.findall(r'from "\./([^"]+)"', text):
                assert mod in assets, (name, mod)
            # Data goes in as text, never as HTML.
            assert "innerHTML" not in text and "insertAdjacentHTML" not in text, name


def test_the_page_is_open_the_data_is_not() -> None:
    auth = AdminAuth(AuthConfig.model_validate({"admin_token": "t0k"}))
    assert not auth.protects("/mars/ui") and not auth.protects("/mars/ui/app.js")
    assert auth.protects("/mars/uix") and auth.protects("/mars/v1/state")
    assert auth.protects("/mars/v1/events")


async def test_served_with_type_and_security_headers() -> None:
    cfg = load_config(None, environ={}, overrides={
        "workers": [{"url": "http://127.0.0.1:9"}], "auth": {"admin_token": "t0k"},
        "probes": {"nvml": {"enabled": False}},
    })
    async with TestClient(TestServer(create_app(cfg))) as client:
        r = await client.get("/mars/ui")
        assert r.status == 200 and r.content_type == "text/html"
        assert "<title>marsproxy</title>" in await r.text()
        for key, value in SECURITY_HEADERS.items():
            assert r.headers[key] == value
        r = await client.get("/mars/ui/app.js")
        assert r.status == 200 and r.content_type == "text/javascript"
        r = await client.get("/mars/ui/secret.txt")
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "not_found"
        # Sent as written (the client would resolve the dots itself): refused, never a file.
        raw = URL(f"{client.make_url('')}/mars/ui/%2e%2e/%2e%2e/pyproject.toml", encoded=True)
        r = await client.session.get(raw)
        assert r.status == 400
        r = await client.get("/mars/v1/state")  # the page's data still needs the token
        assert r.status == 401
