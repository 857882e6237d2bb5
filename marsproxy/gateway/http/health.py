"""Worker health: periodic ``GET /health`` plus connect failures seen by the relay.

``WorkerHealth`` is the pure counter logic (consecutive failures eject, consecutive successes
readmit); ``HealthChecker`` is the asyncio loop that feeds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from marsproxy.config import HealthConfig, WorkerConfig

log = logging.getLogger("marsproxy.gateway.http.health")


@dataclass
class _State:
    healthy: bool = True  # optimistic until proven otherwise, so the first requests flow
    fails: int = 0
    oks: int = 0


class WorkerHealth:
    def __init__(self, workers: Sequence[str], *, unhealthy_after: int, healthy_after: int) -> None:
        self._states = {w: _State() for w in workers}
        self._eject_after = unhealthy_after
        self._admit_after = healthy_after
        self._healthy = tuple(workers)  # every request asks; it changes only in record()

    def healthy(self) -> list[str]:
        return list(self._healthy)

    def is_healthy(self, worker: str) -> bool:
        return self._states[worker].healthy

    def snapshot(self) -> dict[str, bool]:
        return {w: s.healthy for w, s in self._states.items()}

    def record(self, worker: str, ok: bool) -> bool:
        """Count one check (or connect) result; True when the worker's health changed."""
        s = self._states[worker]
        if ok:
            s.fails, s.oks = 0, s.oks + 1
            if not s.healthy and s.oks >= self._admit_after:
                s.healthy = True
                self._changed()
                return True
        else:
            s.oks, s.fails = 0, s.fails + 1
            if s.healthy and s.fails >= self._eject_after:
                s.healthy = False
                self._changed()
                return True
        return False

    def _changed(self) -> None:
        self._healthy = tuple(w for w, s in self._states.items() if s.healthy)


class HealthChecker:
    def __init__(
        self,
        workers: Sequence[WorkerConfig],
        health: WorkerHealth,
        cfg: HealthConfig,
        on_change: Callable[[str, bool], None],
    ) -> None:
        self._workers = list(workers)
        self._health = health
        self._cfg = cfg
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None

    def record(self, worker: WorkerConfig, ok: bool) -> None:
        if self._health.record(worker.url, ok):
            now_ok = self._health.is_healthy(worker.url)
            log.warning("worker %s is now %s", worker.label, "healthy" if now_ok else "ejected")
            self._on_change(worker.url, now_ok)

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        results = await asyncio.gather(*(self._check(session, w) for w in self._workers))
        for w, ok in zip(self._workers, results, strict=True):
            self.record(w, ok)

    async def _check(self, session: aiohttp.ClientSession, worker: WorkerConfig) -> bool:
        timeout = aiohttp.ClientTimeout(total=self._cfg.timeout_s)
        try:
            async with session.get(worker.url + "/health", timeout=timeout) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("health check of %s failed: %r", worker.label, exc)
            return False

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self._loop(session), name="marsproxy-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            try:
                await self.check_all(session)
            except Exception:  # one failed round must not end the checks for good
                log.exception("health checks failed")
            await asyncio.sleep(self._cfg.interval_s)
