"""The Redis stream sink's shutdown, with a pipeline whose reply the test holds back."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from marsproxy.core.events import ToolStart
from marsproxy.telemetry.bus import EventBus
from marsproxy.telemetry.sinks import RedisStreamSink


class _SlowRedis:
    """Records each XADD once its pipeline's reply is let through."""

    def __init__(self) -> None:
        self.added: list[float] = []
        self.in_write = asyncio.Event()
        self.reply = asyncio.Event()

    def pipeline(self, transaction: bool = False) -> _SlowRedis._Pipe:
        return _SlowRedis._Pipe(self)

    class _Pipe:
        def __init__(self, redis: _SlowRedis) -> None:
            self._redis = redis
            self._data: list[str] = []

        def xadd(self, key: str, fields: dict[str, str], **_: Any) -> None:
            self._data.append(fields["data"])

        async def execute(self) -> None:
            self._redis.in_write.set()
            await self._redis.reply.wait()
            self._redis.added += [json.loads(d)["ts"] for d in self._data]


async def test_stop_during_a_write_loses_no_event() -> None:
    redis, bus = _SlowRedis(), EventBus()
    sink = RedisStreamSink(bus, redis, "k", maxlen=100)
    sink.start()
    for i in range(3):
        bus.publish(ToolStart(ts=float(i)))
    await asyncio.wait_for(redis.in_write.wait(), 5)  # the first batch is on its way
    bus.publish(ToolStart(ts=3.0))
    stopping = asyncio.create_task(sink.stop())
    await asyncio.sleep(0.05)
    assert not stopping.done()  # it waits for the batch in flight
    redis.reply.set()
    await asyncio.wait_for(stopping, 5)
    assert redis.added == [0.0, 1.0, 2.0, 3.0] and sink.written == 4 and sink.errors == 0


async def test_stop_while_idle_returns_at_once() -> None:
    redis, bus = _SlowRedis(), EventBus()
    sink = RedisStreamSink(bus, redis, "k", maxlen=100)
    sink.start()
    await asyncio.sleep(0.01)
    await asyncio.wait_for(sink.stop(), 1)
    assert redis.added == [] and sink.written == 0
