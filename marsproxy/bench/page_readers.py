"""Emulated ``/mars/ui`` pages: what open browser tabs ask of a proxy, without a browser.

Each page does what the page's script does by default: polls
``/mars/v1/state?sessions=1&limit=50`` about once a second, reconnecting when it fails. With
``--events`` each page also reads ``/mars/v1/events`` as NDJSON (``flush_ms=250``), what the
page does once its operator turns on "live events". The overhead benchmark runs these beside a
proxy under load (targets ``marsproxy-<policy>+pages`` and ``marsproxy-<policy>+pages-events``)
to show what open pages cost the request path.

    python -m marsproxy.bench.page_readers --url http://127.0.0.1:8080 --pages 5 [--events]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

STATE_PATH = "/mars/v1/state?sessions=1&limit=50"
EVENTS_PATH = "/mars/v1/events?format=ndjson&flush_ms=250"


@dataclass
class Counts:
    states: int = 0
    event_bytes: int = 0
    errors: int = 0
    first_errors: list[str] = field(default_factory=list)

    def error(self, exc: Exception) -> None:
        self.errors += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(repr(exc))


async def _poll(http: aiohttp.ClientSession, url: str, period_s: float, n: Counts) -> None:
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        try:
            async with http.get(url + STATE_PATH) as r:
                await r.read()
                n.states += r.status == 200
        except aiohttp.ClientError as exc:
            n.error(exc)
        await asyncio.sleep(max(0.05, period_s - (loop.time() - t0)))


async def _stream(http: aiohttp.ClientSession, url: str, n: Counts) -> None:
    while True:
        try:
            async with http.get(url + EVENTS_PATH) as r:
                async for chunk in r.content.iter_any():
                    n.event_bytes += len(chunk)
        except aiohttp.ClientError as exc:
            n.error(exc)
        await asyncio.sleep(0.5)


async def run_pages(
    url: str, pages: int, period_s: float, token: str, stop: asyncio.Event,
    events: bool = False,
) -> Counts:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    n = Counts()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as http:
        tasks = [asyncio.create_task(_poll(http, url, period_s, n)) for _ in range(pages)]
        if events:
            tasks += [asyncio.create_task(_stream(http, url, n)) for _ in range(pages)]
        await stop.wait()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
    return n


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Emulated /mars/ui pages reading a proxy.")
    p.add_argument("--url", required=True, help="the proxy's base URL")
    p.add_argument("--pages", type=int, default=5)
    p.add_argument("--period", type=float, default=1.0, help="seconds between state polls")
    p.add_argument("--events", action="store_true",
                   help="each page also reads the event stream (the page's live events on)")
    args = p.parse_args(argv)
    token = os.environ.get("MARSPROXY_AUTH__ADMIN_TOKEN", "")

    async def go() -> Counts:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run_pages(args.url, args.pages, args.period, token, stop, args.events)

    n = asyncio.run(go())
    mode = "state and events" if args.events else "state only"
    print(f"pages {args.pages} ({mode}): {n.states} state documents, {n.event_bytes} event bytes,"
          f" {n.errors} errors", flush=True)
    for e in n.first_errors:
        print(f"  error: {e}", flush=True)


if __name__ == "__main__":
    main()
