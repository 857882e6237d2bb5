"""One timer for many waits of the same length (the worker's first-byte timeout); one timer at
a pure core's next deadline (:class:`Alarm`).

An ``asyncio.timeout`` per request schedules and cancels a loop timer and runs its state
machine: 6-9 µs per request here, a few percent of what relaying a request costs. Waits that all
last ``timeout_s`` expire in the order they began, so one ordered table and one loop timer,
armed for the oldest wait, serve all of them: starting and ending a wait is an insertion and a
removal. The timer fires about once per ``timeout_s`` of traffic (it re-arms for the next
oldest wait), and expires each wait at its own deadline, as a timeout around it would.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable


class Wait:
    """One wait, from :meth:`Deadlines.start` to :meth:`Deadlines.end`.

    As with ``asyncio.timeout``, the expiry cancels the waiting task; the waiter turns that
    cancellation into a timeout when :meth:`timed_out` says so, and a cancellation from
    elsewhere stays one.
    """

    __slots__ = ("deadline", "expired", "task")

    def __init__(self, task: asyncio.Task[object], deadline: float) -> None:
        self.task = task
        self.deadline = deadline
        self.expired = False

    def timed_out(self) -> bool:
        """In ``except CancelledError``: whether the cancellation is this wait's expiry (then
        it is taken back, and the task goes on as after a timeout)."""
        return self.expired and self.task.uncancel() == 0


class Deadlines:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._waits: OrderedDict[int, Wait] = OrderedDict()  # oldest first
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> Wait:
        """A wait of the current task, from now."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "Deadlines.start() outside a task"
        w = Wait(task, loop.time() + self.timeout_s)
        self._waits[id(w)] = w
        if self._timer is None:
            self._timer = loop.call_at(w.deadline, self._expire)
        return w

    def end(self, w: Wait) -> None:
        """The wait is over (answered, failed or expired); call it once, in ``finally``."""
        self._waits.pop(id(w), None)

    def __len__(self) -> int:
        return len(self._waits)

    def _expire(self) -> None:
        assert self._loop is not None
        self._timer = None
        now = self._loop.time()
        waits = self._waits
        while waits:
            oldest = next(iter(waits.values()))
            if oldest.deadline > now:  # re-arm for the oldest wait still running
                self._timer = self._loop.call_at(oldest.deadline, self._expire)
                return
            waits.popitem(last=False)
            oldest.expired = True
            oldest.task.cancel()

    def close(self) -> None:
        """Stop the timer (waits still running then never expire); usable again afterwards."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._waits.clear()
        self._loop = None


class Alarm:
    """One loop timer at the earliest deadline a pure core names (the scheduler's next release,
    the plane's next hold end): armed again for a sooner one, left for a later one; ``fire``
    runs at the deadline and names the next."""

    __slots__ = ("_at", "_fire", "_handle")

    def __init__(self, fire: Callable[[], None]) -> None:
        self._fire = fire
        self._handle: asyncio.TimerHandle | None = None
        self._at: float | None = None

    def arm(self, at: float | None, now: float) -> None:
        if at is None or (self._at is not None and self._at <= at):
            return
        if self._handle is not None:
            self._handle.cancel()
        self._at = at
        self._handle = asyncio.get_running_loop().call_later(max(0.0, at - now), self._ring)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._at = None

    def _ring(self) -> None:
        self._handle = self._at = None
        self._fire()
