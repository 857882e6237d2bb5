"""Idle admission through the gateway: a session the forecast-peak fit holds back is let in
once every admitted session has sat in its tool phase, with nothing running on the engine,
for ``admission.tuning.idle_admit_after_s`` (scraped from a real emulated worker's /metrics)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from marsproxy.emulator.server import EmulatorOptions, create_app

_Factory = Any

# 64 blocks of 16 tokens, 10 % reserved: 57 usable. A ~300-token first prompt forecasts
# 2 × 300 = 600 tokens (38 blocks), so the second one's forecast does not fit beside it.
_PROMPT = "word " * 300


def _small_worker() -> web.Application:
    return create_app(EmulatorOptions(profile="tiny", time_scale=0.05, num_blocks=64))


async def _holder_in_its_tool_phase(s: Any) -> asyncio.Task[Any]:
    for _ in range(2):  # an agent: back after a call, so its tool phase holds KV room
        assert (await s.chat("holder", content=_PROMPT))[0] == 200  # then in its tool phase
    waiter = asyncio.create_task(s.chat("waiter", content=_PROMPT))
    await s.until(lambda: _queued(s, 1))
    return waiter


async def test_the_held_session_goes_in_once_the_worker_sat_idle(make_stack: _Factory) -> None:
    # Idle for 1 s, not 0.3: on a loaded machine the waiter's request came more than 0.3 s
    # after the holder's call ended, found the worker idle already and never queued.
    s = await make_stack(window=4, app=_small_worker, peak_free_sessions=0,
                         peak_cheap_sessions=0, idle_admit_after_s=1.0)
    waiter = await _holder_in_its_tool_phase(s)
    assert (await asyncio.wait_for(waiter, 10))[0] == 200
    row = (await s.state())["admission"]["workers"]["w0"]
    assert sorted(row["sessions"]) == ["holder", "waiter"]
    # Both in tool phases now, the worker idle again; the fit still has no room.
    assert row["peak_room_blocks"] is not None and row["peak_room_blocks"] < 19


async def test_off_the_fit_holds_it_until_the_holder_ends(make_stack: _Factory) -> None:
    s = await make_stack(window=4, app=_small_worker, peak_free_sessions=0,
                         peak_cheap_sessions=0, idle_admit=False, idle_admit_after_s=0.3)
    waiter = await _holder_in_its_tool_phase(s)

    async def idle_a_while() -> bool:
        idle = (await s.state())["admission"]["workers"]["w0"]["idle_s"]
        return idle is not None and idle > 1.0

    await s.until(idle_a_while)  # idle far past idle_admit_after_s, and still held
    assert not waiter.done() and await _queued(s, 1)
    assert (await s.chat("holder", final=True))[0] == 200
    assert (await asyncio.wait_for(waiter, 10))[0] == 200


async def _queued(s: Any, n: int) -> bool:
    return bool(await s.queue_length() == n)


async def test_an_idle_admission_past_the_cpu_cap_is_confirmed_by_the_store(
    make_stack: _Factory,
) -> None:
    # The holder's reported tool phase on 1 tool CPU overloads it (marks lowered below a
    # backlog of 1), so the CPU cap binds: 1 tool CPU × 1 session = a limit of 1. An idle
    # engine adds no tool CPU until its call is done, so the idle limit is the window (4). The
    # core admits the waiter past the limit; the store must confirm it against the idle limit,
    # not hold it as pending until the holder ends.
    s = await make_stack(window=4, window_min=1, cpu_cap_backlog=1.0, cpu_backlog_enter=0.9,
                         cpu_backlog_leave=0.5, idle_admit_after_s=0.3, cpu={"tool_cpus": 1.0})
    assert (await s.chat("holder"))[0] == 200
    async with s.http.post(s.url("/mars/v1/sessions/holder/events"),
                           json={"type": "tool_start", "tool": "make"}) as r:
        assert r.status < 300  # now in its tool phase, for good

    async def capped() -> bool:
        row = (await s.state())["admission"]["workers"]["w0"]
        return bool(row["cpu_cap"] == 1 and row["limit"] == 1)

    await s.until(capped)
    assert (await asyncio.wait_for(s.chat("waiter"), 10))[0] == 200
    state = await s.state()
    assert sorted(state["admission"]["workers"]["w0"]["sessions"]) == ["holder", "waiter"]
    assert state["admission"]["queue"]["pending"] == 0
