"""Fixtures for the state-store tests: the shared Redis, a unique pool per test, a private
redis-server that tests may kill and restart, and a fake clock.

The shared Redis on 127.0.0.1:6379 is never stopped; outage tests start their own server on a
free port in a temporary directory.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis

SHARED_URL = "redis://127.0.0.1:6379/0"


class FakeClock:
    """Epoch-like milliseconds that only move when a test says so."""

    def __init__(self) -> None:
        self.now = 1_800_000_000_000

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += ms


def delete_pool(url: str, pool: str) -> None:
    r = redis.Redis.from_url(url)
    try:
        keys = list(r.scan_iter(f"mars:{{{pool}}}:*", count=1000))
        if keys:
            r.delete(*keys)
    finally:
        r.close()


@pytest.fixture
def pool() -> Iterator[str]:
    """A pool name of its own on the shared Redis; its keys are deleted afterwards."""
    r = redis.Redis.from_url(SHARED_URL, socket_connect_timeout=1)
    try:
        r.ping()
    except Exception as exc:  # .ci/run starts Redis; a bare `pytest` elsewhere may have none
        pytest.skip(f"no Redis on 127.0.0.1:6379 ({exc!r})")
    finally:
        r.close()
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    delete_pool(SHARED_URL, name)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


Poll = Callable[[Callable[[], Any], float], Awaitable[float]]


@pytest.fixture
def eventually() -> Poll:
    return _eventually


async def _eventually(cond: Callable[[], Any], timeout_s: float, step_s: float = 0.02) -> float:
    """Polls ``cond()`` (sync or async) until true; returns the seconds it took."""
    start = time.monotonic()
    while True:
        got = cond()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(step_s)
