"""Cheap preemption through the gateway: a real emulated worker's /metrics give the scraper
its prefill speed, re-prefilling a forecast peak there takes milliseconds, so while the
admitted sessions sit in tool phases the forecast-peak fit overcommits
(``admission.tuning.peak_cheap_reprefill_s``); with the limit at a microsecond it does not."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from marsproxy.emulator.server import EmulatorOptions, create_app

_Factory = Any

# 128 blocks of 16 tokens, 10 % reserved: 116 usable. A ~420-token first prompt forecasts
# about 2 × 420 tokens (53 blocks): two fit together, a third does not.
_PROMPT = "word " * 300


def _worker() -> web.Application:
    return create_app(EmulatorOptions(profile="tiny", time_scale=0.05, num_blocks=128))


async def _two_in_tools_and_a_third(s: Any) -> asyncio.Task[Any]:
    for name in ("a", "b"):  # agents: back after a call, so their tool phases hold KV room
        for _ in range(2):
            assert (await s.chat(name, content=_PROMPT))[0] == 200  # then in its tool phase

    async def measured() -> bool:
        row = (await s.state())["admission"]["workers"]["w0"]
        return row["reprefill_s"] is not None

    await s.until(measured)  # the scraper has the worker's prefill speed
    return asyncio.create_task(s.chat("c", content=_PROMPT))


async def test_cheap_reprefill_lets_a_third_in_while_two_sit_in_tools(
    make_stack: _Factory,
) -> None:
    s = await make_stack(window=8, app=_worker, peak_free_sessions=2, idle_admit=False)
    third = await _two_in_tools_and_a_third(s)
    assert (await asyncio.wait_for(third, 10))[0] == 200
    row = (await s.state())["admission"]["workers"]["w0"]
    assert sorted(row["sessions"]) == ["a", "b", "c"]
    assert 0 < row["reprefill_s"] < 1.0


async def test_dear_reprefill_keeps_the_third_waiting(make_stack: _Factory) -> None:
    s = await make_stack(window=8, app=_worker, peak_free_sessions=2, idle_admit=False,
                         peak_cheap_reprefill_s=1e-6)
    third = await _two_in_tools_and_a_third(s)
    await asyncio.sleep(0.3)  # several control ticks and scrapes
    row = (await s.state())["admission"]["workers"]["w0"]
    assert row["peak_overcommit"] == 1.0 and row["reprefill_s"] > 1e-6
    assert not third.done() and await s.queue_length() == 1
    assert (await s.chat("a", content=_PROMPT, final=True))[0] == 200  # a slot in the fit
    assert (await asyncio.wait_for(third, 10))[0] == 200
