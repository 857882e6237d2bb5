"""One timer for many waits of the same length (the first-byte timeout)."""

from __future__ import annotations

import asyncio

import pytest

from marsproxy.gateway.shells.deadlines import Deadlines


async def _wait_for(d: Deadlines, seconds: float) -> str:
    """Sleep ``seconds`` inside a wait: 'done', or 'timeout' when the wait expired."""
    w = d.start()
    try:
        try:
            await asyncio.sleep(seconds)
        finally:
            d.end(w)
    except asyncio.CancelledError:
        if not w.timed_out():
            raise
        return "timeout"
    return "done"


async def test_a_wait_past_its_deadline_times_out_others_do_not() -> None:
    d = Deadlines(0.2)
    results = await asyncio.gather(_wait_for(d, 0.01), _wait_for(d, 5.0), _wait_for(d, 0.05))
    assert results == ["done", "timeout", "done"]
    assert len(d) == 0


async def test_waits_expire_at_their_own_deadlines_one_after_another() -> None:
    d = Deadlines(0.15)
    loop = asyncio.get_running_loop()
    ended: list[tuple[int, float]] = []

    async def one(i: int) -> None:
        t0 = loop.time()
        assert await _wait_for(d, 5.0) == "timeout"
        ended.append((i, loop.time() - t0))

    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(0.05)  # later starts: later deadlines, one timer re-armed
    await asyncio.gather(*tasks)
    assert [i for i, _ in ended] == [0, 1, 2]
    assert all(0.15 <= took < 1.0 for _, took in ended)


async def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    d = Deadlines(10.0)
    task = asyncio.create_task(_wait_for(d, 5.0))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(d) == 0


async def test_an_ended_wait_leaves_nothing_that_fires_later() -> None:
    d = Deadlines(0.05)
    assert await _wait_for(d, 0.0) == "done"
    await asyncio.sleep(0.1)  # the timer fires, finds no wait, and is not re-armed
    assert await _wait_for(d, 0.0) == "done"
    assert len(d) == 0
    d.close()
