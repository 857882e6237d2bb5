"""Run a synchronous probe read every ``period_s`` and hand each result on (NVML, CPU).

The vLLM scraper has its own loops (it does HTTP); these probes are plain function calls, so
one small generic shell serves both. A read that raises is logged once per failing run and
counted; the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Poller(Generic[T]):
    """Calls ``read()`` every ``period_s``; keeps the latest result; calls ``on_sample`` with it.

    ``in_thread``: run each read in a worker thread. Use it for NVML, whose calls can block
    for seconds on a wedged driver and must not stall the event loop; file reads (CPU) are
    cheap enough to run inline.
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
            value = await asyncio.to_thread(self._read) if self._in_thread else self._read()
        except Exception as exc:
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

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await self.poll_once()
            await asyncio.sleep(max(0.0, self.period_s - (loop.time() - began)))
