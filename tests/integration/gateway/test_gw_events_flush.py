"""``/mars/v1/events?flush_ms=``: the same events, gathered into fewer writes (what the live page
asks for), and a bad value named in a 400. Real sockets, the fake worker of conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from marsproxy.config import load_config
from marsproxy.gateway.http.app import Running, start


@pytest.fixture
async def gw(fake: Any) -> AsyncIterator[Running]:
    g = await start(load_config(None, environ={}, overrides={
        "workers": [fake.url], "server": {"port": 0},
        "probes": {"vllm": {"period_s": 0.05}, "nvml": {"enabled": False}},
    }))
    yield g
    await g.stop()


async def _read(resp: aiohttp.ClientResponse, into: list[dict[str, Any]], reads: list[int]) -> None:
    rest = b""
    while True:
        chunk = await resp.content.readany()
        if not chunk:
            return
        rest += chunk
        *lines, rest = rest.split(b"\n")
        got = [json.loads(x) for x in lines if x.strip()]
        if got:
            reads.append(len(got))
            into.extend(got)


def _requests(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("session")]


async def test_flush_gathers_the_same_events_into_fewer_writes(gw: Running,
                                                               until: Any) -> None:
    base = f"http://127.0.0.1:{gw.port}"
    async with aiohttp.ClientSession() as http:
        for bad in ("-1", "5001", "soon"):
            async with http.get(f"{base}/mars/v1/events?flush_ms={bad}") as r:
                assert r.status == 400
                assert (await r.json())["error"]["message"].startswith("flush_ms: ")
        now_ev: list[dict[str, Any]] = []
        now_reads: list[int] = []
        flushed: list[dict[str, Any]] = []
        flushed_reads: list[int] = []
        r_now = await http.get(f"{base}/mars/v1/events?format=ndjson")
        r_flush = await http.get(f"{base}/mars/v1/events?format=ndjson&flush_ms=400")
        tasks = [asyncio.create_task(_read(r_now, now_ev, now_reads)),
                 asyncio.create_task(_read(r_flush, flushed, flushed_reads))]
        try:
            for i in range(8):
                async with http.post(f"{base}/v1/chat/completions", headers={
                    "x-session-id": f"flush-{i}", "x-session-final": "true",
                }, json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]}) as r:
                    assert r.status == 200
                    await r.read()
            await until(lambda: len(_requests(now_ev)) >= 40
                        and len(_requests(flushed)) == len(_requests(now_ev)), within=10)
        finally:
            for resp in (r_now, r_flush):
                resp.close()
            for t in tasks:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await t
    # The same events, in the same order (probe samples go on arriving; compare the rest).
    n = len(_requests(flushed))
    assert _requests(flushed) == _requests(now_ev)[:n] and n >= 40
    # Eight requests' events in a few gathered writes: at most one per 400 ms of the run.
    assert len(flushed_reads) < len(flushed) / 4, (flushed_reads, now_reads)
