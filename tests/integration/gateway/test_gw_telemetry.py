"""The information stream through the gateway, over real sockets: the event stream (filters,
SSE subscriptions, keep-alives, shutdown), refusals as events, and the JSONL and Redis sinks.

Workers are the scriptable fake of conftest.py (it also serves a small vLLM /metrics page).
Sessions' events, the tool tracker and the admin session API: test_gw_session_events.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from marsproxy.gateway.http.app import Running, start

from .telemetry_client import CHAT, Events, chat, config, url


async def test_stream_filters_by_type_and_session(gw: Running, http: aiohttp.ClientSession,
                                                  until: Any) -> None:
    async with Events(http, gw, "&type=llm_end") as only_ends, \
            Events(http, gw, "&session=f1") as only_f1:
        await chat(http, gw, "f1")
        await chat(http, gw, "f2")
        await until(lambda: len(only_ends.got) == 2 and len(only_f1.got) >= 4)
        await asyncio.sleep(0.1)
    assert {e["type"] for e in only_ends.got} == {"llm_end"}
    assert {e["session"].rsplit("/", 1)[1] for e in only_ends.got} == {"f1", "f2"}
    assert only_f1.got and all(e["session"].endswith("/id/f1") for e in only_f1.got)
    async with http.get(url(gw, "/mars/v1/events?type=nope")) as r:
        assert r.status == 400 and "type:" in (await r.json())["error"]["message"]


async def test_sse_client_that_leaves_closes_its_subscription(
    gw: Running, http: aiohttp.ClientSession, until: Any
) -> None:
    bus = gw.gateway.telemetry.bus
    base = bus.subscribers
    resp = await http.get(url(gw, "/mars/v1/events"))
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    assert bus.subscribers == base + 1
    await chat(http, gw, "sse")
    text = b""
    while b"event: llm_end\n" not in text:
        text += await resp.content.readany()
    assert b"data: {" in text
    resp.close()  # the client goes away
    await until(lambda: bus.subscribers == base)


async def test_rejections_are_events(dead_url: str, http: aiohttp.ClientSession,
                                     until: Any) -> None:
    g = await start(config([dead_url], health={"interval_s": 0.05, "unhealthy_after": 1}))
    try:
        await until(lambda: not g.gateway.healthy())
        async with Events(http, g, "&type=rejected") as ev:
            async with http.post(url(g, "/v1/chat/completions"), json=CHAT) as r:
                assert r.status == 503
            async with http.post(url(g, "/v1/chat/completions"), data=b"{nope") as r:
                assert r.status == 400
            await until(lambda: len(ev.got) == 2)
        assert [(e["reason"], e["status"]) for e in ev.got] == [
            ("no_healthy_worker", 503), ("invalid_json", 400)
        ]
    finally:
        await g.stop()


async def test_jsonl_sink_writes_the_run(fake: Any, http: aiohttp.ClientSession,
                                         tmp_path: Path, until: Any) -> None:
    path = tmp_path / "events.jsonl"
    tel = {"jsonl_path": str(path), "pressure_sample_every": 1}
    g = await start(config([fake.url], telemetry=tel))
    try:
        samples = g.gateway.telemetry.bus.subscribe(lambda e: e.type == "pressure_sample")
        await chat(http, g, "j1")
        await chat(http, g, "j1", final=True)
        await until(lambda: bool(samples.poll()))
    finally:
        await g.stop()  # flushes the sink
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    mine = [r["type"] for r in rows if (r.get("session") or "").endswith("/id/j1")]
    assert mine == [
        "session_queued", "session_admitted",
        "dispatch", "first_token", "llm_end", "retention_decision", "tool_start",
        "tool_end", "dispatch", "first_token", "llm_end", "session_end",
    ]
    assert any(r["type"] == "pressure_sample" for r in rows)


async def test_redis_stream_sink_from_config(fake: Any, http: aiohttp.ClientSession) -> None:
    import uuid

    import redis.asyncio as aioredis

    r = aioredis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=1)
    try:
        await r.ping()
    except Exception as exc:  # .ci/run starts Redis; a bare `pytest` elsewhere may have none
        await r.aclose()
        pytest.skip(f"no Redis on 127.0.0.1:6379 ({exc!r})")
    key = f"marsproxy-test:{uuid.uuid4().hex}:events"
    rs = {"url": "redis://127.0.0.1:6379/0", "key": key, "maxlen": 1000}
    g = await start(config([fake.url], telemetry={"redis_stream": rs}))
    try:
        await chat(http, g, "r1", final=True)
    finally:
        await g.stop()
    try:
        entries: Any = await r.xrange(key)
        rows = [json.loads(fields[b"data"]) for _, fields in entries]
        mine = [e["type"] for e in rows if (e.get("session") or "").endswith("/id/r1")]
        assert mine == ["session_queued", "session_admitted", "dispatch", "first_token",
                        "llm_end", "session_end"]
    finally:
        await r.delete(key)
        await r.aclose()


async def test_sse_keepalive_and_shutdown_ends_open_streams(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    # A long drain timeout: stopping must not wait for the live stream to end by itself.
    g = await start(config([fake.url], telemetry={"sse_keepalive_s": 0.05},
                          server={"drain_timeout_s": 600}))
    stopped = False
    resp = await http.get(url(g, "/mars/v1/events"))
    try:
        text = b""
        while text.count(b": keep-alive\n\n") < 3:  # the first comes at once, then when idle
            text += await resp.content.readany()
        assert b"event:" not in text
        await asyncio.wait_for(g.stop(), 10)
        stopped = True
        while await resp.content.readany():  # the proxy ended the stream: EOF, not a hang
            pass
    finally:
        resp.close()  # (if stop hung: the client leaving lets the rest of the shutdown finish)
        if not stopped:
            await g.stop()
