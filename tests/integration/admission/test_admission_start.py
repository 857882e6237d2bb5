"""The first requests after start: before any worker's first scrape nothing is known (every
worker is stale, fail closed), so a new session waits; it is decided as soon as that scrape
lands, not at the next control tick (up to ``control_interval_s`` later)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from marsproxy.emulator.server import EmulatorOptions, create_app

_Factory = Any


async def test_a_session_held_before_the_first_scrape_goes_in_when_it_lands(
    make_stack: _Factory,
) -> None:
    scrapes = asyncio.Event()  # the worker's /metrics answers only once set

    def worker() -> web.Application:
        app = create_app(EmulatorOptions(profile="tiny", time_scale=0.05))

        @web.middleware
        async def metrics_held(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            if request.path.startswith("/metrics"):  # /metrics/?name[]=...: the scraper
                await scrapes.wait()
            return await handler(request)

        app.middlewares.append(metrics_held)
        return app

    # A control period far longer than the test: only the scrape can let the session in.
    s = await make_stack(window=4, app=worker, control_interval_s=60.0,
                         vllm={"timeout_s": 30.0, "stale_after_s": 60.0})
    try:
        chat = asyncio.create_task(s.chat("first"))

        async def held() -> bool:
            return await s.queue_length() == 1

        await s.until(held)
        assert not chat.done()
        scrapes.set()
        status, _, _ = await asyncio.wait_for(chat, 10)
        assert status == 200
        assert (await s.state())["admission"]["workers"]["w0"]["sessions"] == ["first"]
    finally:
        scrapes.set()  # the scraper's pending request ends before the stack stops
