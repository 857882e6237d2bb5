"""The information-stream tests' side of a gateway: its config (fast probes), a background
reader of the event stream, and the requests the tests send.

Shared by test_gw_telemetry.py (the stream and its sinks) and test_gw_session_events.py
(sessions' events, tool phases, the admin session API): one file would be over 400 lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp

from marsproxy.config import MarsConfig, load_config
from marsproxy.gateway.http.app import Running

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
AUTH = {"Authorization": "Bearer sk-tenant-a"}


def config(workers: list[str], **sections: Any) -> MarsConfig:
    over: dict[str, Any] = {
        "workers": workers,
        "server": {"port": 0},
        "probes": {"vllm": {"period_s": 0.05, "idle_period_s": 0.05, "stale_after_s": 0.3},
                   "nvml": {"enabled": False}},
    }
    for k, v in sections.items():
        over[k] = {**over.get(k, {}), **v}
    return load_config(None, environ={}, overrides=over)


def url(g: Running, path: str) -> str:
    return f"http://127.0.0.1:{g.port}{path}"


class Events:
    """Reads ``/mars/v1/events?format=ndjson`` in the background into ``got``."""

    def __init__(self, http: aiohttp.ClientSession, g: Running, query: str = "") -> None:
        self._http, self._url = http, url(g, "/mars/v1/events?format=ndjson" + query)
        self.got: list[dict[str, Any]] = []
        self._resp: aiohttp.ClientResponse | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Events:
        self._resp = await self._http.get(self._url)
        assert self._resp.status == 200
        assert self._resp.headers["Content-Type"].startswith("application/x-ndjson")
        self._task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self._resp is not None
        async for line in self._resp.content:
            if line.strip():  # blank lines are keep-alives
                self.got.append(json.loads(line))

    async def __aexit__(self, *_: object) -> None:
        assert self._resp is not None and self._task is not None
        self._resp.close()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            await self._task

    def of(self, session_id: str) -> list[dict[str, Any]]:
        return [e for e in self.got if (e.get("session") or "").endswith("/id/" + session_id)]

    def types(self, session_id: str) -> list[str]:
        return [e["type"] for e in self.of(session_id)]


async def chat(
    http: aiohttp.ClientSession, g: Running, session: str, *, final: bool = False,
    stream: bool = False, auth: dict[str, str] = AUTH,
) -> None:
    headers = {**auth, "x-session-id": session}
    if final:
        headers["x-session-final"] = "true"
    async with http.post(
        url(g, "/v1/chat/completions"), json={**CHAT, "stream": stream}, headers=headers
    ) as r:
        assert r.status == 200
        await r.read()


async def post_event(
    http: aiohttp.ClientSession, g: Running, session: str, body: Any,
    auth: dict[str, str] = AUTH,
) -> tuple[int, dict[str, Any]]:
    async with http.post(
        url(g, f"/mars/v1/sessions/{session}/events"), json=body, headers=auth
    ) as r:
        return r.status, await r.json()


async def state(http: aiohttp.ClientSession, g: Running, query: str = "") -> dict[str, Any]:
    async with http.get(url(g, "/mars/v1/state" + query)) as r:
        assert r.status == 200
        return await r.json()  # type: ignore[no-any-return]
