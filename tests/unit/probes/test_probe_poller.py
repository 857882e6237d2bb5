"""Poller: the asyncio shell that runs NVML / CPU reads periodically."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from marsproxy.probes.poller import Poller


async def test_poll_once_keeps_latest_and_calls_back() -> None:
    values = iter([1, 2])
    seen: list[int] = []
    p = Poller("x", lambda: next(values), 1.0, on_sample=seen.append)
    assert await p.poll_once() == 1
    assert await p.poll_once() == 2
    assert (p.latest, seen, p.errors) == (2, [1, 2], 0)


async def test_errors_are_counted_and_logged_once_per_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    script: list[int | Exception] = [RuntimeError("a"), RuntimeError("b"), 5, RuntimeError("c")]

    def read() -> int:
        item = script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    p: Poller[int] = Poller("x", read, 1.0)
    with caplog.at_level(logging.WARNING, logger="marsproxy.probes.poller"):
        results = [await p.poll_once() for _ in range(4)]
    assert results == [None, None, 5, None]
    assert p.errors == 3 and p.latest == 5
    assert len(caplog.records) == 2  # the two failing runs, not the three errors


async def test_in_thread_reads_off_the_event_loop() -> None:
    loop_thread = threading.get_ident()
    p = Poller("x", threading.get_ident, 1.0, in_thread=True)
    assert await p.poll_once() != loop_thread


async def test_loop_polls_until_stopped() -> None:
    got = asyncio.Event()
    count = 0

    def on_sample(_: int) -> None:
        nonlocal count
        count += 1
        if count >= 3:
            got.set()

    p = Poller("x", lambda: 1, 0.01, on_sample=on_sample)
    await p.start()
    await p.start()  # idempotent: still one loop
    await asyncio.wait_for(got.wait(), timeout=10)
    await p.stop()
    after = count
    await asyncio.sleep(0.05)
    assert count == after  # nothing runs after stop


async def test_a_wedged_threaded_read_fails_at_its_period_and_blocks_no_exit() -> None:
    """A read that does not return (a wedged GPU driver) is a failed read after one period:
    the last reading is not current any more, no second read piles up behind it, and its
    thread is a daemon (the interpreter's exit would join a pool thread for good)."""
    release = threading.Event()
    started: list[threading.Thread] = []

    def read() -> int:
        started.append(threading.current_thread())
        if len(started) == 2:
            release.wait()
        return len(started)

    p = Poller("wedge", read, 0.05, in_thread=True)
    assert await p.poll_once() == 1 and p.latest == 1
    assert await asyncio.wait_for(p.poll_once(), 5) is None  # the second read hangs
    assert p.latest is None and p.errors == 1
    assert await p.poll_once() is None  # still hanging: no new read started
    assert len(started) == 2 and p.errors == 2
    assert started[1].daemon and started[1].is_alive()
    release.set()
    started[1].join(5)
    await asyncio.sleep(0.01)  # its answer reaches the loop
    assert await p.poll_once() == 3 and p.latest == 3  # it came back: reads go on
