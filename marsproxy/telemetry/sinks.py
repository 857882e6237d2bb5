"""Sinks that drain the event bus: a JSONL file and a Redis stream.

Each sink is a task reading its own subscription, so a slow disk or a slow Redis loses the
oldest events (counted by the bus) instead of slowing the proxy. A sink that fails logs the
failure once per kind and keeps going.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import Any, TextIO

from marsproxy.config import ConfigError
from marsproxy.core.events import Event, event_to_dict
from marsproxy.telemetry.bus import EventBus, Subscription

log = logging.getLogger(__name__)


def _line(ev: Event) -> str:
    return json.dumps(event_to_dict(ev), separators=(",", ":")) + "\n"


class JsonlSink:
    """Appends one JSON object per event to ``path`` (what the benchmark reads)."""

    def __init__(self, bus: EventBus, path: str | Path) -> None:
        self._sub: Subscription = bus.subscribe()
        self._path = Path(path)
        self._file: TextIO | None = None
        self._task: asyncio.Task[None] | None = None
        self.written = 0

    def start(self) -> None:
        """Open the file (a :class:`ConfigError` if it cannot be: the proxy does not start
        rather than drop every event) and start writing."""
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self._path.open("a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"telemetry.jsonl_path: cannot append to {self._path}:"
                              f" {exc.strerror}") from None
        self._task = asyncio.create_task(self._run(self._file), name="jsonl-sink")

    async def _run(self, f: TextIO) -> None:
        while True:
            batch = await self._sub.get_batch()
            f.write("".join(_line(ev) for ev in batch))
            f.flush()
            self.written += len(batch)

    async def stop(self) -> None:
        """Write what is still queued, then stop."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._file is None:  # never started, or refused at start
            self._sub.close()
            return
        rest = self._sub.poll(limit=1 << 30)
        if rest:
            self._file.write("".join(_line(ev) for ev in rest))
            self.written += len(rest)
        self._file.close()
        self._file = None
        self._sub.close()


class RedisStreamSink:
    """``XADD key MAXLEN ~ maxlen * data <json>`` per event, pipelined per batch."""

    def __init__(self, bus: EventBus, redis: Any, key: str, maxlen: int) -> None:
        self._sub = bus.subscribe()
        self._redis = redis
        self._key = key
        self._maxlen = maxlen
        self._task: asyncio.Task[None] | None = None
        self.written = 0
        self.errors = 0
        self._ok = True  # the last write worked (a Redis that is down is not waited for at stop)
        self._stopping = False
        self._writing = False  # a batch taken from the subscription is on its way to Redis

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="redis-stream-sink")

    async def _run(self) -> None:
        # redis-py 8.1 can swallow a task's cancellation inside a command; the flag ends the
        # loop anyway, so stop() never waits on a task that did not notice it was cancelled.
        while not self._stopping:
            batch = await self._sub.get_batch(limit=512)
            self._writing = True
            try:
                await self._write(batch)
            except Exception as exc:  # Redis down: drop this batch, keep the proxy going
                self._failed(exc)
            finally:
                self._writing = False
            if not self._ok:
                await asyncio.sleep(1.0)

    async def _write(self, batch: list[Event]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for ev in batch:
            pipe.xadd(
                self._key, {"data": _line(ev).rstrip("\n")},
                maxlen=self._maxlen, approximate=True,
            )
        await pipe.execute()
        self.written += len(batch)
        self._ok = True

    def _failed(self, exc: BaseException) -> None:
        self._ok = False
        self.errors += 1
        if self.errors == 1 or self.errors % 1000 == 0:
            log.warning("redis event sink %s: %r (%d failed batches)", self._key, exc, self.errors)

    async def stop(self, flush_timeout_s: float = 2.0) -> None:
        """Write what is still queued (for at most ``flush_timeout_s``: Redis may be gone)."""
        self._stopping = True
        if self._task is not None:
            # A batch in flight is finished, not cancelled: it has left the subscription, and a
            # cancelled write would lose it (the first events of a short run, sent while the
            # connection is still being made). Waiting for events, the task holds none.
            if not self._writing:
                self._task.cancel()
            await asyncio.wait({self._task}, timeout=flush_timeout_s)
            if not self._task.done():
                self._task.cancel()
                log.warning("redis event sink %s did not stop in time; abandoning it", self._key)
        rest = self._sub.poll(limit=1 << 30)
        self._sub.close()
        if not rest or not self._ok:
            return
        try:
            async with asyncio.timeout(flush_timeout_s):
                for i in range(0, len(rest), 512):
                    await self._write(rest[i : i + 512])
        except Exception as exc:  # including the timeout: shutdown must not hang on Redis
            self._failed(exc)
