"""Asking the workers which one keeps a stored reply (gateway/shells/replies.py), over real
sockets: the one answering 200 wins, whatever the others do (404, an error, silence); none, or
silence past the timeout, is ``None``; those that answered 404 are named (they keep no such
reply); the caller's credentials go with the question."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from marsproxy.gateway.shells.replies import worker_keeping

from .conftest import run_app


def _worker(status: int, delay_s: float = 0.0, seen: list[str] | None = None) -> web.Application:
    async def get(request: web.Request) -> web.Response:
        if seen is not None:
            seen.append(f"{request.raw_path} {request.headers.get('Authorization')}")
        await asyncio.sleep(delay_s)
        return web.json_response({"id": request.match_info["rid"]}, status=status)

    app = web.Application()
    app.router.add_get("/v1/responses/{rid}", get)
    return app


async def test_the_worker_that_has_it_answers() -> None:
    seen: list[str] = []
    runners = [await run_app(_worker(404, seen=seen)), await run_app(_worker(500)),
               await run_app(_worker(200, delay_s=0.05, seen=seen)),
               await run_app(_worker(200, delay_s=30))]
    urls = [u for _, u in runners]
    try:
        async with aiohttp.ClientSession() as http:
            got = await worker_keeping(http, urls, "resp_1/x", {"Authorization": "Bearer k"}, 5)
            none = await worker_keeping(http, urls[:2], "resp_1/x", {}, 5)
            silent = await worker_keeping(http, urls[3:], "resp_1/x", {}, 0.2)
    finally:
        for r, _ in runners:
            await r.cleanup()
    assert (got[0], none, silent) == (urls[2], (None, [urls[0]]), (None, []))
    assert got[1] in ([], [urls[0]])  # the 404 is told when it came before the 200
    assert seen[:2] == ["/v1/responses/resp_1%2Fx Bearer k"] * 2  # quoted; the key sent along
