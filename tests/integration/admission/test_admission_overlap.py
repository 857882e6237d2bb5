"""The measured overlap through the gateway: sessions seen holding little of their forecast
peaks (a real emulated worker's /metrics: KV usage and the preemption counter) let the
forecast-peak fit admit past its strict limit; with ``peak_overcommit_max`` at 1 it does not."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from marsproxy.emulator.server import EmulatorOptions, create_app

_Factory = Any

# 128 blocks of 16 tokens, 10 % reserved: 116 usable. A ~210-token first prompt forecasts
# about 2 × 210 tokens (27 blocks): four fit together, a fifth does not.
_PROMPT = "word " * 150


def _worker() -> web.Application:
    return create_app(EmulatorOptions(profile="tiny", time_scale=0.05, num_blocks=128))


async def _four_in_tools_and_one_that_ran_its_course(s: Any) -> asyncio.Task[Any]:
    # Agents: a comes back after its first call, so their tool phases hold KV room.
    assert (await s.chat("a", content=_PROMPT))[0] == 200
    for name in ("a", "b", "c"):
        assert (await s.chat(name, content=_PROMPT))[0] == 200  # now in its tool phase
    assert (await s.chat("done", content=_PROMPT))[0] == 200
    assert (await s.chat("done", content=_PROMPT, final=True))[0] == 200  # a lifetime
    assert (await s.chat("d", content=_PROMPT))[0] == 200
    late = asyncio.create_task(s.chat("late", content=_PROMPT))
    return late


async def test_sessions_seen_holding_little_let_a_fifth_in(make_stack: _Factory) -> None:
    s = await make_stack(window=8, app=_worker, peak_free_sessions=0, idle_admit=False)
    late = await _four_in_tools_and_one_that_ran_its_course(s)
    assert (await asyncio.wait_for(late, 10))[0] == 200
    st = (await s.state())["admission"]
    row = st["workers"]["w0"]
    assert sorted(row["sessions"]) == ["a", "b", "c", "d", "late"]
    assert row["peak_overlap"] < 0.8 and row["peak_overcommit"] > 1.0
    assert st["session_lifetime_s"] is not None and st["session_lifetime_s"] > 0


async def test_without_the_overcommit_the_fifth_waits(make_stack: _Factory) -> None:
    s = await make_stack(window=8, app=_worker, peak_free_sessions=0, idle_admit=False,
                         peak_overcommit_max=1.0)
    late = await _four_in_tools_and_one_that_ran_its_course(s)

    async def measured() -> bool:
        row = (await s.state())["admission"]["workers"]["w0"]
        return bool(row["peak_overlap"] < 0.5)

    await s.until(measured)  # the overlap reads low, and the factor stays at 1
    row = (await s.state())["admission"]["workers"]["w0"]
    assert row["peak_overcommit"] == 1.0
    assert not late.done() and await s.queue_length() == 1
    assert (await s.chat("a", content=_PROMPT, final=True))[0] == 200  # a slot in the fit
    assert (await asyncio.wait_for(late, 10))[0] == 200
