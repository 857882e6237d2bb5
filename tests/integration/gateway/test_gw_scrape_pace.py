"""The pace of the gateway's ``/metrics`` scrapes: ``probes.vllm.idle_period_s`` while nothing
waits, ``period_s`` from the moment a session waits for admission until it is admitted.

The idle period is an hour here, so any scrape beyond the first while nothing waits is one the
waiting session caused; a slow machine can only make fewer scrapes, never more.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from marsproxy.config import load_config
from marsproxy.gateway.http.app import start


async def test_scrapes_are_slow_while_nothing_waits_and_fast_while_a_session_waits(
    fake: Any, http: aiohttp.ClientSession, until: Any
) -> None:
    cfg = load_config(None, environ={}, overrides={
        "workers": [{"url": fake.url, "name": "w0"}],
        "server": {"port": 0},
        "probes": {"vllm": {"period_s": 0.02, "idle_period_s": 3600, "stale_after_s": 7200},
                   "nvml": {"enabled": False}},
        # One session at a time; the fake engine runs nothing between calls, so idle
        # admission would let the second one in at once.
        "admission": {"window_init": 1, "window_min": 1, "window_max": 1,
                      "tuning": {"idle_admit": False}},
    })
    proxy = await start(cfg)
    url = f"http://127.0.0.1:{proxy.port}/v1/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    async def chat(sid: str, final: bool = False) -> int:
        headers = {"x-session-id": sid, "x-session-final": "true" if final else "false"}
        async with http.post(url, json=body, headers=headers) as r:
            await r.read()
            return r.status

    try:
        await until(lambda: fake.scrapes >= 1)  # the first scrape, at start
        assert await chat("holder") == 200  # admitted at once: nothing waited
        idle = fake.scrapes
        await asyncio.sleep(0.3)
        assert fake.scrapes == idle, "scraped at the fast pace while nothing waited"

        waiter = asyncio.create_task(chat("waiter"))
        # Waiting: scraped at once, then every period_s while it waits.
        await until(lambda: fake.scrapes >= idle + 5)
        assert not waiter.done()
        assert await chat("holder", final=True) == 200  # its end admits the waiter
        assert await asyncio.wait_for(waiter, 10) == 200
        await asyncio.sleep(0.1)  # a scrape in flight as the wait ended may still finish
        settled = fake.scrapes
        await asyncio.sleep(0.3)
        assert fake.scrapes <= settled + 1, "still scraping fast after the wait ended"
    finally:
        await proxy.stop()
