"""Sinks against real files and a real Redis."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from marsproxy.core.events import LlmEnd, SessionEnd, ToolStart
from marsproxy.telemetry.bus import EventBus
from marsproxy.telemetry.sinks import JsonlSink, RedisStreamSink


async def test_jsonl_sink_writes_every_event(tmp_path: Path) -> None:
    bus = EventBus()
    path = tmp_path / "events" / "e.jsonl"
    sink = JsonlSink(bus, path)
    sink.start()
    for i in range(50):
        bus.publish(LlmEnd(ts=float(i), session="t:a", prompt_tokens=i))
    await asyncio.sleep(0.05)
    bus.publish(SessionEnd(ts=99.0, session="t:a", reason="final"))
    await sink.stop()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 51 and sink.written == 51
    assert rows[0] == {"type": "llm_end", "ts": 0.0, "session": "t:a", "worker": None,
                       "status": 200, "latency_s": 0.0, "prompt_tokens": 0,
                       "cached_tokens": 0, "completion_tokens": 0}
    assert rows[-1]["type"] == "session_end" and rows[-1]["reason"] == "final"


async def _redis() -> aioredis.Redis:
    r = aioredis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=1)
    try:
        await r.ping()
    except Exception as exc:  # .ci/run starts Redis; a bare `pytest` elsewhere may have none
        pytest.skip(f"no Redis on 127.0.0.1:6379 ({exc!r})")
    return r


async def test_redis_stream_sink_xadds_with_a_bound() -> None:
    r = await _redis()
    key = f"marsproxy-test:{uuid.uuid4().hex}:events"
    bus = EventBus()
    sink = RedisStreamSink(bus, r, key, maxlen=100)
    sink.start()
    try:
        for i in range(1000):
            bus.publish(ToolStart(ts=float(i), session="t:s", tool="pytest"))
        for _ in range(100):
            if sink.written >= 1000:
                break
            await asyncio.sleep(0.02)
        assert sink.written == 1000 and sink.errors == 0
        length = await r.xlen(key)
        assert 100 <= length < 1000  # MAXLEN ~ trims, approximately
        last = await r.xrevrange(key, count=1)
        assert json.loads(last[0][1][b"data"])["ts"] == 999.0
    finally:
        await sink.stop()
        await r.delete(key)
        await r.aclose()


async def test_redis_stream_sink_survives_a_dead_redis() -> None:
    dead = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    bus = EventBus()
    sink = RedisStreamSink(bus, dead, "k", maxlen=10)
    sink.start()
    bus.publish(ToolStart(ts=1.0))
    for _ in range(250):  # redis-py retries a refused connect a few times first
        if sink.errors:
            break
        await asyncio.sleep(0.02)
    assert sink.errors >= 1 and sink.written == 0
    bus.publish(ToolStart(ts=2.0))  # publishing still never blocks
    await sink.stop()
    await dead.aclose()
