"""The floor of the overhead benchmark: the least an aiohttp reverse proxy can do.

An aiohttp server whose one handler sends each request to the upstream through one pooled
``ClientSession`` and relays the answer (streamed as it arrives), with marsproxy's header
filtering and nothing else: no sessions, no policy, no metrics, no events, no timeouts. It is
what marsproxy's HTTP stack (aiohttp server and client on uvloop) costs by itself, so the
benchmark can tell marsproxy's own per-request work from its stack's.

Run: ``python -m marsproxy.bench.overhead_relay --port 9001 --upstream http://127.0.0.1:9000``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Sequence

import aiohttp
from aiohttp import web

from marsproxy.gateway.http.loop import run
from marsproxy.gateway.http.upstream import request_headers, response_headers

SESSION_KEY = web.AppKey("relay_session", aiohttp.ClientSession)


def create_app(upstream: str) -> web.Application:
    app = web.Application()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with app[SESSION_KEY].request(
            request.method, upstream + request.path_qs,
            headers=request_headers(request.headers, identity=False), data=body,
            allow_redirects=False,
        ) as up:
            resp = web.StreamResponse(status=up.status, headers=response_headers(up.headers))
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def session(app: web.Application) -> AsyncIterator[None]:
        async with aiohttp.ClientSession(auto_decompress=False) as s:
            app[SESSION_KEY] = s
            yield

    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


async def _serve(port: int, upstream: str) -> None:
    runner = web.AppRunner(create_app(upstream), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await asyncio.Event().wait()  # until the process is killed
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:9000")
    args = p.parse_args(argv)
    run(lambda: _serve(args.port, args.upstream.rstrip("/")), "auto")


if __name__ == "__main__":
    main()
