"""Operator and agent input to the admin API (``/mars/v1/...``) over real sockets: every query
parameter the proxy cannot read as given is a 400 naming it (in the message and in ``param``),
never read as something else; ids the clients chose are echoed bounded.

The routes' other answers: test_gw_session_events.py (sessions), test_gw_telemetry.py (stream).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from marsproxy.gateway.http.app import Running

from .telemetry_client import AUTH, CHAT, chat, url


async def _error(
    http: aiohttp.ClientSession, method: str, target: str, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    async with http.request(method, target, headers=headers) as r:
        assert r.status == 400  # (before reading: a stream that opened would never end)
        body = await r.json()
        assert r.headers["x-marsproxy-reason"] == body["error"]["code"]
        assert set(body["error"]) == {"message", "type", "param", "code"}
        return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(("query", "param"), [
    ("sessions=banana", "sessions"),  # was read as "no details"
    ("sessions=1&limt=5", "limt"),  # a typo was ignored: the default page came back
    ("sessions=1&limit=5&limit=7", "limit"),  # which one counts?
    ("sessions=1&limit=1_0", "limit"),  # Python's int() reads "1_0" as 10
    ("sessions=1&limit=%EF%BC%95", "limit"),  # ... and a full-width "5" as 5
    ("sessions=1&limit=+5", "limit"),
    ("sessions=1&limit=0", "limit"),
    ("sessions=1&limit=" + "9" * 5000, "limit"),
    ("sessions=1&offset=-1", "offset"),
    ("sessions=1&offset=" + "9" * 40, "offset"),
])
async def test_state_refuses_what_it_cannot_read(
    gw: Running, http: aiohttp.ClientSession, query: str, param: str
) -> None:
    err = await _error(http, "GET", url(gw, "/mars/v1/state?" + query))
    assert err["param"] == param
    assert err["message"].startswith(param + ":")
    assert len(err["message"]) < 300  # a 5000-digit value is not echoed whole


@pytest.mark.parametrize(("path", "param"), [
    ("/mars/v1/events?format=ndjson&flush=250", "flush"),
    ("/mars/v1/events?flush_ms=1_000", "flush_ms"),
    ("/mars/v1/events?format=sse&format=ndjson", "format"),
    ("/mars/v1/openapi.json?x=1", "x"),
])
async def test_other_operator_endpoints_refuse_unknown_or_repeated_parameters(
    gw: Running, http: aiohttp.ClientSession, path: str, param: str
) -> None:
    err = await _error(http, "GET", url(gw, path))
    assert err["param"] == param


async def test_session_endpoints_refuse_query_parameters(
    gw: Running, http: aiohttp.ClientSession
) -> None:
    await chat(http, gw, "s-q")
    err = await _error(http, "DELETE", url(gw, "/mars/v1/sessions/s-q?force=1"), AUTH)
    assert err["param"] == "force"
    # Refused before anything happened: the session is still there.
    async with http.get(url(gw, "/mars/v1/state?sessions=true")) as r:
        ids = [d["id"] for d in (await r.json())["sessions"]["details"]]
    assert "s-q" in ids


async def test_the_accepted_spellings_still_work(gw: Running, http: aiohttp.ClientSession) -> None:
    await chat(http, gw, "s-ok")
    for flag, shown in (("1", True), ("TRUE", True), ("yes", True), ("0", False), ("no", False)):
        async with http.get(url(gw, f"/mars/v1/state?sessions={flag}&limit=1000&offset=0")) as r:
            assert r.status == 200
            assert ("details" in (await r.json())["sessions"]) is shown


async def test_a_long_unknown_id_is_not_echoed_whole(
    gw: Running, http: aiohttp.ClientSession
) -> None:
    # The head cap (limits.max_header_bytes) lets a path of several KB through; the 404's
    # message (and its log line) shows a bounded prefix of the id.
    async with http.delete(url(gw, "/mars/v1/sessions/" + "x" * 6000)) as r:
        assert r.status == 404
        body = await r.json()
    assert body["error"]["code"] == "session_not_found"
    assert len(body["error"]["message"]) < 300


async def test_the_agent_trees_in_the_state_are_bounded(
    gw: Running, http: aiohttp.ClientSession
) -> None:
    # Every state document (each poll of the live page, each scrape) carried every parent
    # with every live child: up to sessions.max_sessions ids. It shows the first 50 parents,
    # 50 children each (by id), and counts them all.
    async def child(i: int) -> None:
        headers = {**AUTH, "x-session-id": f"c{i:03d}", "x-parent-session-id": "p"}
        async with http.post(url(gw, "/v1/chat/completions"), json=CHAT, headers=headers) as r:
            assert r.status == 200
            await r.read()

    await chat(http, gw, "p")
    for i in range(0, 120, 20):
        await asyncio.gather(*(child(i + k) for k in range(20)))
    async with http.get(url(gw, "/mars/v1/state")) as r:
        sessions = (await r.json())["sessions"]
    assert sessions["trees"] == {"p": [f"c{i:03d}" for i in range(50)]}
    assert sessions["linked"] == 120
