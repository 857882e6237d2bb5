"""A KV hold's end through the gateway: the session waiting for the room a dormant session's
forecast holds goes in when that hold ends (the admission shell's timer at the plane's next
deadline), not at the next control tick. The tick here is 10 minutes apart: only the timer
can let it in within the test's bound."""

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


async def test_a_waiting_session_goes_in_when_the_hold_ends_not_at_the_tick(
    make_stack: _Factory,
) -> None:
    s = await make_stack(window=4, app=_small_worker, peak_free_sessions=0,
                         peak_cheap_sessions=0, idle_admit=False, kv_hold_min_s=6.0,
                         control_interval_s=600.0)
    for _ in range(2):  # an agent: back after a call, so its tool phase holds KV room
        assert (await s.chat("holder", content=_PROMPT))[0] == 200
    waiter = asyncio.create_task(s.chat("waiter", content=_PROMPT))
    # The holder's forecast keeps it out for 6 s: long enough for a loaded machine to see it
    # wait (with 2 s, a clean-clone run once let the hold end before the waiter was queued).
    await s.until(lambda: _queued(s, 1))
    assert (await asyncio.wait_for(waiter, 30))[0] == 200  # the next tick is minutes away
    row = (await s.state())["admission"]["workers"]["w0"]
    assert sorted(row["sessions"]) == ["holder", "waiter"]  # the holder is admitted still


async def _queued(s: Any, n: int) -> bool:
    return bool(await s.queue_length() == n)
