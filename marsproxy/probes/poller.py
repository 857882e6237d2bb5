"""Run a synchronous probe read every ``period_s`` and hand each result on (NVML, CPU).

The vLLM scraper has its own loops (it does HTTP); these probes are plain function calls, so
one small generic shell serves both. A read that raises is logged once per failing run and
counted; the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def daemon_call(fn: Callable[[], T], name: str) -> tuple[threading.Thread, asyncio.Future[T]]:
    """Start ``fn()`` in a daemon thread of its own; its future settles on the running loop.

    Not the default executor: a call that never returns (a wedged GPU driver) would hold one
    of its threads for good, and the interpreter's exit joins those threads, so the proxy could
    not stop. A daemon thread is abandoned at exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():  # given up on (cancelled) meanwhile
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        value: Any
        try:
            ok, value = True, fn()
        except BaseException as exc:  # handed to whoever awaits it
            ok, value = False, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, ok, value)

    # Read here if nobody awaits it any more (given up on at a timeout): no "never retrieved".
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, fut


class Poller(Generic[T]):
    """Calls ``read()`` every ``period_s``; keeps the latest result; calls ``on_sample`` with it.

    ``in_thread``: run each read in a thread of its own. Use it for NVML, whose calls can block
    on a wedged driver and must not stall the event loop; file reads (CPU) are cheap enough to
    run inline. A threaded read that has not returned within ``period_s`` is a failed read and
    clears ``latest`` (it is not current any more); no new read starts until it returns.
    """

    def __init__(
        self,
        name: str,
        read: Callable[[], T],
        period_s: float,
        *,
        on_sample: Callable[[T], None] | None = None,
        in_thread: bool = False,
    ) -> None:
        self.name = name
        self._read = read
        self.period_s = period_s
        self._on_sample = on_sample
        self._in_thread = in_thread
        self._task: asyncio.Task[None] | None = None
        self.latest: T | None = None
        self.errors = 0
        self._failing = False
        self._reading: asyncio.Future[T] | None = None  # the last threaded read

    async def start(self) -> None:
        """Start polling (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"poll-{self.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def poll_once(self) -> T | None:
        """One read now; the result, or ``None`` when it raised (never raises but cancellation)."""
        try:
            value = await self._threaded() if self._in_thread else self._read()
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                self.latest = None
            self.errors += 1
            if not self._failing:
                self._failing = True
                log.warning("probe %s read failed: %s: %s", self.name, type(exc).__name__, exc)
            return None
        self._failing = False
        self.latest = value
        if self._on_sample is not None:
            try:
                self._on_sample(value)
            except Exception:
                log.exception("probe %s: on_sample callback failed", self.name)
        return value

    async def _threaded(self) -> T:
        if self._reading is not None and not self._reading.done():
            raise TimeoutError("the last read has not returned yet")
        self._reading = fut = daemon_call(self._read, f"probe-{self.name}")[1]
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.period_s)
        except TimeoutError:
            raise TimeoutError(f"no answer within {self.period_s} s (a wedged driver?)") from None

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await self.poll_once()
            await asyncio.sleep(max(0.0, self.period_s - (loop.time() - began)))
