"""The agents' HTTP client in ``bench live``: idle connections close before the worker's do."""

from __future__ import annotations

import asyncio

from aiohttp import web

from marsproxy.bench.live import AGENT_KEEPALIVE_S, agents_http
from marsproxy.bench.local import start_local

UVICORN_KEEPALIVE_S = 5.0  # vLLM's API server closes idle connections after this


async def _peers_of_calls(keepalive_s: float, gaps: list[float]) -> list[int]:
    """The client port of each call made ``gaps`` seconds apart (a new port: a new connection)."""
    ports: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        ports.append(peer[1] if peer else -1)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    server = await start_local(app)
    try:
        async with agents_http(5.0, keepalive_s) as http:
            for gap in [0.0, *gaps]:
                await asyncio.sleep(gap)
                async with http.post(f"{server.url}/v1/chat/completions", json={}) as r:
                    assert r.status == 200
    finally:
        await server.runner.cleanup()
    return ports


async def test_idle_connections_close_after_the_keepalive() -> None:
    ports = await _peers_of_calls(0.2, [0.02, 0.5])
    assert ports[0] == ports[1]  # back at once: the pooled connection
    assert ports[2] != ports[1]  # idle past the keep-alive: closed by the client, a new one


def test_agents_close_idle_connections_before_vllm_does() -> None:
    # A call on a connection the server is closing fails ("Server disconnected").
    assert 0 < AGENT_KEEPALIVE_S < UVICORN_KEEPALIVE_S
