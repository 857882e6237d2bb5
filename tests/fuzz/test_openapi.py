"""The admin API's OpenAPI document: served, true to the routes, and fuzzed by schemathesis.

schemathesis (the CLI, as an operator would run it) generates requests from the document the
live proxy serves, with the admin token configured, and checks every answer against it: no
server errors, only documented statuses and content types, bodies that match their schemas,
and the token actually enforced.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

import pytest

from marsproxy.config import load_config
from marsproxy.gateway.admin.openapi import build_openapi
from marsproxy.gateway.http.app import create_app

Live = Any  # conftest.py's live stack


def _admin_routes(with_token: bool) -> set[tuple[str, str]]:
    cfg = load_config(
        None, environ={},
        overrides={"workers": ["http://127.0.0.1:9"],
                   "auth": {"admin_token": "t" if with_token else ""}},
    )
    app = create_app(cfg)
    out = set()
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if path.startswith("/mars/v1/") and route.method != "*":
            out.add((route.method.lower(), path))
    return out


@pytest.mark.parametrize("with_token", [True, False])
def test_document_lists_exactly_the_admin_routes(with_token: bool) -> None:
    doc = build_openapi(auth=with_token)
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert documented == _admin_routes(with_token)


def test_operator_operations_declare_the_token_only_when_one_is_set() -> None:
    with_auth, without = build_openapi(auth=True), build_openapi(auth=False)
    for doc, expect in ((with_auth, [{"adminToken": []}]), (without, [])):
        for path, ops in doc["paths"].items():
            for op in ops.values():
                tenant_scoped = path.startswith("/mars/v1/sessions/")
                assert op["security"] == ([] if tenant_scoped else expect), path
    assert "securitySchemes" not in without["components"]


def test_the_proxy_serves_its_document(live: Live) -> None:
    r = live.http.get("/mars/v1/openapi.json", headers=live.admin)
    assert r.status_code == 200
    assert r.json() == build_openapi(auth=True)


@pytest.mark.skipif(shutil.which("schemathesis", path=os.path.dirname(sys.executable)) is None,
                    reason="schemathesis is not installed (dev dependency)")
def test_schemathesis_against_a_live_proxy(live: Live, tmp_path: Any) -> None:
    # Sessions to aim at, so that positive cases reach the handlers past the 404.
    for sid in ("0", "a", "session-1"):
        assert live.chat(sid, key="sk-st").status_code == 200
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run",
        f"{live.url}/mars/v1/openapi.json",
        "--header", f"Authorization: Bearer {live.token}",
        "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
        "response_schema_conformance,response_headers_conformance,ignored_auth",
        # The event stream never ends by itself; its answers are checked in test_limits.
        "--exclude-path", "/mars/v1/events",
        # Bounded by examples (a --max-time would make fuzzing repeat until it is spent).
        "--max-examples", "100", "--seed", "1", "--workers", "1",
        "--request-timeout", "10", "--no-color",
        "--generation-database", "none", "--report-dir", str(tmp_path),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "passed" in out.lower()
