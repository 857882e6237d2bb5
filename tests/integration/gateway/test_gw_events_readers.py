"""Readers of ``/mars/v1/events`` that do not behave: one that stops reading, many at once,
ones that leave mid-stream. The proxy keeps serving, holds a bounded amount for each, and
forgets every reader that is gone.

The stalled reader is a real aiohttp client whose socket takes little (a 4 KiB receive
buffer) and whose response is never read: once its buffers and the proxy's are full, the
proxy's writes to it block.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp

from marsproxy.gateway.http.app import Running, start

from .telemetry_client import CHAT, config, url

BIG_ID = "s" * 200  # larger events: the buffers fill after fewer requests


def _small_receive_buffer(addr: Any) -> socket.socket:
    family, type_, proto, _, _ = addr
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return sock


def _stalled_client() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(socket_factory=_small_receive_buffer)
    )


async def _traffic(http: aiohttp.ClientSession, g: Running, n: int, first: int = 0) -> None:
    """``n`` one-shot sessions, 50 at a time; each must succeed."""
    async def one(i: int) -> None:
        headers = {"x-session-id": f"{BIG_ID}{i}", "x-session-final": "true"}
        async with http.post(url(g, "/v1/chat/completions"), json=CHAT, headers=headers) as r:
            assert r.status == 200
            await r.read()

    for start_i in range(first, first + n, 50):
        await asyncio.gather(*(one(i) for i in range(start_i, min(first + n, start_i + 50))))


async def test_a_reader_that_stops_reading_is_cut_off_and_the_proxy_keeps_serving(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    g = await start(config([fake.url], telemetry={"sse_keepalive_s": 0.3}))
    bus = g.gateway.telemetry.bus
    try:
        async with _stalled_client() as stalled:
            resp = await stalled.get(url(g, "/mars/v1/events?format=ndjson"))
            assert resp.status == 200 and bus.subscribers == 1
            # Never read. Requests go on being served while the reader's buffers fill; once a
            # write has waited a keep-alive interval the proxy drops the reader.
            sent = 0
            while bus.subscribers and sent < 20_000:
                await _traffic(http, g, 500, sent)
                sent += 500
                await asyncio.sleep(0.4)
            assert bus.subscribers == 0, f"still subscribed after {sent} requests"
            await _traffic(http, g, 50, sent)  # and the proxy serves on
            resp.close()
    finally:
        await g.stop()


async def test_shutdown_does_not_wait_on_a_stalled_reader(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    # A long drain and keep-alive: only the shutdown itself may end the stalled write.
    g = await start(config([fake.url], telemetry={"sse_keepalive_s": 600},
                          server={"drain_timeout_s": 600}))
    stopped = False
    async with _stalled_client() as stalled:
        resp = await stalled.get(url(g, "/mars/v1/events?format=ndjson"))
        try:
            assert resp.status == 200
            # More than the loopback buffers hold (MBs): the proxy's write to it now blocks.
            await _traffic(http, g, 6000)
            await asyncio.wait_for(g.stop(), 10)
            stopped = True
        finally:
            resp.close()  # (if stop hung: the reader leaving lets the shutdown finish)
            if not stopped:
                await g.stop()


async def test_many_readers_leaving_mid_stream_leave_no_subscription(
    gw: Running, http: aiohttp.ClientSession, until: Any
) -> None:
    bus = gw.gateway.telemetry.bus
    readers = [await http.get(url(gw, "/mars/v1/events?format=ndjson&flush_ms=10"))
               for _ in range(20)]
    assert all(r.status == 200 for r in readers) and bus.subscribers == 20
    traffic = asyncio.create_task(_traffic(http, gw, 400))
    for r in readers:  # each gets some of the stream, then leaves while events still flow
        assert await r.content.readline() is not None
        r.close()
    await traffic
    await until(lambda: bus.subscribers == 0)
