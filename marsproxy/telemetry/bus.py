"""The in-process event bus: one ring buffer, many cursors.

Publishing appends to a single bounded ring and, only when someone waits, resolves one shared
future: no per-subscriber work and no per-subscriber allocation on the hot path. Each subscriber
reads from its own cursor; a subscriber that falls more than the ring's capacity behind loses the
oldest events, and the loss is counted (per subscriber and in total) instead of slowing the
publisher.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

from marsproxy.core.events import Event

EventFilter = Callable[[Event], bool]


class EventBus:
    def __init__(self, capacity: int = 65_536) -> None:
        self._ring: deque[Event] = deque(maxlen=capacity)
        self._next_seq = 0  # sequence number the next published event gets
        self._waiter: asyncio.Future[None] | None = None
        self.published_total = 0
        self.dropped_total = 0
        self.subscribers = 0

    def publish(self, event: Event) -> None:
        """Never blocks; callable from synchronous code on the loop thread."""
        if not self.subscribers:
            self.skip()
            return
        self._ring.append(event)
        self._next_seq += 1
        self.published_total += 1
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def skip(self) -> None:
        """Count an event that nobody can read, without keeping it.

        With no subscriber, an event is never read: a new subscription starts at the next
        event published. So the request path, which publishes several events per request,
        need not even build them then (it checks :attr:`subscribers` first); the ring stays
        empty instead of holding ``capacity`` dead events for the garbage collector to walk.
        """
        if self._ring:
            self._ring.clear()
        self._next_seq += 1
        self.published_total += 1

    def subscribe(self, accept: EventFilter | None = None) -> Subscription:
        """A cursor starting at the next event published."""
        return Subscription(self, self._next_seq, accept)

    # -- used by Subscription -------------------------------------------------------------
    def _oldest_seq(self) -> int:
        return self._next_seq - len(self._ring)

    def _read(self, seq: int, limit: int) -> tuple[list[Event], int, int]:
        """Events from ``seq`` on (at most ``limit``), the next cursor and how many were lost."""
        oldest = self._oldest_seq()
        lost = 0
        if seq < oldest:
            lost = oldest - seq
            seq = oldest
        n = min(self._next_seq - seq, limit)
        if n <= 0:
            return [], seq, lost
        start = seq - oldest
        ring = self._ring
        return [ring[i] for i in range(start, start + n)], seq + n, lost

    async def _wait(self, seq: int) -> None:
        if seq < self._next_seq:
            return
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_future()
        # shield: one subscriber being cancelled must not cancel the future others wait on
        await asyncio.shield(self._waiter)


class Subscription:
    """One reader's cursor into the bus. Iterate it, or call :meth:`get_batch`."""

    def __init__(self, bus: EventBus, seq: int, accept: EventFilter | None) -> None:
        self._bus = bus
        self._seq = seq
        self._accept = accept
        self.dropped = 0
        self._closed = False
        bus.subscribers += 1

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._bus.subscribers -= 1

    def poll(self, limit: int = 1024) -> list[Event]:
        """What is there now, without waiting."""
        events, self._seq, lost = self._bus._read(self._seq, limit)
        if lost:
            self.dropped += lost
            self._bus.dropped_total += lost
        if self._accept is not None:
            events = [e for e in events if self._accept(e)]
        return events

    async def get_batch(self, limit: int = 1024) -> list[Event]:
        """Wait until at least one accepted event is there; return what is there."""
        while True:
            events = self.poll(limit)
            if events:
                return events
            await self._bus._wait(self._seq)

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            while True:
                for ev in await self.get_batch():
                    yield ev
        finally:
            self.close()
