"""The upstream body reader's idle timeout against a real aiohttp server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from marsproxy.gateway.http.upstream import BodyReader


async def _trickle(request: web.Request) -> web.StreamResponse:
    """Chunks every ``gap`` s, ``n`` of them, then (``stall``) silence before the end."""
    gap, n = float(request.query["gap"]), int(request.query["n"])
    resp = web.StreamResponse()
    await resp.prepare(request)
    for i in range(n):
        await resp.write(f"chunk{i};".encode())
        await asyncio.sleep(gap)
    await asyncio.sleep(float(request.query.get("stall", "0")))
    await resp.write_eof()
    return resp


@pytest.fixture
async def base_url() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/", _trickle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}/"
    await runner.cleanup()


async def _read_all(reader: BodyReader) -> bytes:
    out = b""
    while chunk := await reader.read():
        out += chunk
    return out


async def test_steady_chunks_outlast_the_idle_timeout(base_url: str) -> None:
    # 8 chunks 0.05 s apart: 0.4 s in all, never 0.15 s silent.
    async with aiohttp.ClientSession() as s, s.get(base_url + "?gap=0.05&n=8") as resp:
        reader = BodyReader(resp, idle_s=0.15)
        body = await _read_all(reader)
    assert body == b"".join(f"chunk{i};".encode() for i in range(8))


async def test_silence_raises_timeout_error(base_url: str) -> None:
    async with aiohttp.ClientSession() as s, s.get(base_url + "?gap=0&n=2&stall=1") as resp:
        reader = BodyReader(resp, idle_s=0.2)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            await _read_all(reader)
        assert 0.15 < loop.time() - t0 < 2.0


async def test_time_between_reads_is_not_silence(base_url: str) -> None:
    # The caller is busy (a slow client) for longer than the timeout between two reads.
    async with aiohttp.ClientSession() as s, s.get(base_url + "?gap=0.01&n=3") as resp:
        reader = BodyReader(resp, idle_s=0.1)
        out = [await reader.read()]
        await asyncio.sleep(0.3)
        out.append(await _read_all(reader))
    assert b"".join(out) == b"chunk0;chunk1;chunk2;"


async def test_outside_cancel_stays_a_cancel(base_url: str) -> None:
    async with aiohttp.ClientSession() as s, s.get(base_url + "?gap=0&n=1&stall=1") as resp:
        reader = BodyReader(resp, idle_s=0.2)
        await reader.read()
        task = asyncio.create_task(reader.read())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        reader.close()
