"""The upstream wait, as the overhead clock subtracts it, timed on uvloop (``marsproxy serve``'s
loop) against a real aiohttp server on loopback."""

from __future__ import annotations

import asyncio

import uvloop
from aiohttp import web
from multidict import CIMultiDict

from marsproxy.config import UpstreamConfig, WorkerConfig
from marsproxy.gateway.http.upstream import Upstream


async def _waits(n: int) -> list[float]:
    app = web.Application()

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app.router.add_post("/v1/chat/completions", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    worker = WorkerConfig(url=f"http://127.0.0.1:{runner.addresses[0][1]}")
    up = Upstream(UpstreamConfig(), on_error=lambda w, why: None)
    await up.start()
    waits: list[float] = []
    try:
        for _ in range(n):
            opened = await up.open("POST", "/v1/chat/completions", CIMultiDict(), b"{}",
                                   lambda tried: None if tried else worker)
            await opened.body.read()
            opened.response.release()
            waits.append(opened.upstream_s)
            await asyncio.sleep(0.002)  # spread over the loop's millisecond ticks
    finally:
        await up.close()
        await runner.cleanup()
    return waits


def test_a_sub_millisecond_round_trip_is_timed_on_uvloop() -> None:
    # uvloop's loop.time() is a cached millisecond clock: a round trip of a fraction of a
    # millisecond read as 0 (or 1 ms), and the overhead header, the wall time less this
    # wait, as up to 1 ms off. Every real round trip takes some time.
    waits = uvloop.run(_waits(20))
    assert all(w > 0 for w in waits), waits
    assert min(waits) < 0.5, waits  # a wait, not a second
