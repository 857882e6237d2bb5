"""The first requests after start: before any worker's first scrape nothing is known (every
worker is stale, fail closed), so a new session waits; it is decided as soon as that scrape
lands, not at the next control tick (up to ``control_interval_s`` later). A control tick that
ran while the worker was unseen holds it at ``window_min`` only until the worker is seen."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from marsproxy.emulator.server import EmulatorOptions, create_app

_Factory = Any
# The scrape waits for the test, never for a timeout; a control period far longer than the
# test: only the scrape (and the request path) can let sessions in.
_HELD = {"control_interval_s": 60.0, "vllm": {"timeout_s": 30.0, "stale_after_s": 60.0}}


def _metrics_held(scrapes: asyncio.Event) -> Callable[[], web.Application]:
    """An emulated worker whose ``/metrics`` answers only once ``scrapes`` is set."""

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

    return worker


async def test_a_session_held_before_the_first_scrape_goes_in_when_it_lands(
    make_stack: _Factory,
) -> None:
    scrapes = asyncio.Event()
    s = await make_stack(window=4, app=_metrics_held(scrapes), **_HELD)
    try:
        chat = asyncio.create_task(s.chat("first"))

        async def held() -> bool:
            return bool(await s.queue_length() == 1)

        await s.until(held)
        assert not chat.done()
        scrapes.set()
        status, _, _ = await asyncio.wait_for(chat, 10)
        assert status == 200
        assert (await s.state())["admission"]["workers"]["w0"]["sessions"] == ["first"]
    finally:
        scrapes.set()  # the scraper's pending request ends before the stack stops


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_burst_after_the_first_scrape_is_not_held_at_the_floor(
    make_stack: _Factory, backend: str, request: pytest.FixtureRequest,
) -> None:
    """The control tick at start saw the worker unseen (limit ``window_min``, 1 here); a burst
    of three arriving once the scrape has landed, well within the control period, all go in:
    the worker's limit is 4 as soon as it is seen, not a period later. With Redis the store
    enforces the windows the leader published: none for a worker it has not seen."""
    store = None
    if backend == "redis":
        url = request.getfixturevalue("private_redis").url
        store = {"backend": "redis", "redis_url": url, "pool": "start", "op_timeout_s": 2.0}
    scrapes = asyncio.Event()
    s = await make_stack(window=4, window_min=1, app=_metrics_held(scrapes), store=store,
                         **_HELD)
    try:
        async def ticked_unseen() -> bool:  # the start's control tick ran: stale, at the floor
            w = (await s.state())["admission"]["workers"]["w0"]
            return bool(w["stale"]) and w["effective_limit"] == 1

        await s.until(ticked_unseen)
        scrapes.set()

        async def scraped() -> bool:
            return (await s.state())["workers"][0]["kv_usage"] is not None

        await s.until(scraped)
        chats = [asyncio.create_task(s.chat(f"burst-{i}")) for i in range(3)]
        done = await asyncio.wait_for(asyncio.gather(*chats), 10)
        assert [status for status, _, _ in done] == [200, 200, 200]
        w = (await s.state())["admission"]["workers"]["w0"]
        assert not w["stale"] and w["effective_limit"] == 4
        assert sorted(w["sessions"]) == ["burst-0", "burst-1", "burst-2"]
    finally:
        scrapes.set()
