"""Requests that outlast ``sessions.idle_ttl_s``: a session held for admission or streaming
that long is in use, not idle (found by the soak: the table forgot such sessions, which
answered the held one 503 ``session_ended`` and freed the slot under a running stream).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.faults.conftest import Lab, bounded, call, chat_body, headers, until

pytestmark = pytest.mark.timeout(60)

IDLE_TTL_S = 0.5


async def test_sessions_busy_longer_than_the_idle_ttl_are_kept(lab: Lab) -> None:
    w = lab.emulator("w0", time_scale=3.0)
    p = lab.proxy(lab.config({"w0": w}, {
        "sessions": {"idle_ttl_s": IDLE_TTL_S},
        "admission": {"window_init": 1, "window_min": 1, "window_max": 1},
    }))
    started = asyncio.Event()

    async def long_stream() -> str:  # about 4 s, eight idle TTLs
        async with p.http.post(
            f"{p.url}/v1/chat/completions", json=chat_body("long", tokens=1500, stream=True),
            headers=headers("long", final=True),
        ) as r:
            first = await r.content.readuntil(b"\n\n")
            started.set()
            return (first + await r.content.read()).decode()

    stream = asyncio.create_task(long_stream())
    await bounded(started.wait(), 10, "the long stream starts")
    held = asyncio.create_task(call(p.http, p.url, "held", final=True))
    await until(p.state, lambda st: st["admission"]["queue"]["length"] == 1, "held queued", 5)
    await asyncio.sleep(3 * IDLE_TTL_S)
    st = await p.state()
    assert not stream.done() and not held.done()
    assert st["admission"]["workers"]["w0"]["sessions"] == ["long"]  # still its slot
    assert st["admission"]["queue"]["length"] == 1  # still waiting, not refused
    text = await bounded(stream, 15, "the long stream")
    assert text.endswith("data: [DONE]\n\n")
    r = await bounded(held, 10, "the held session after the slot freed")
    assert r.status == 200, r.body
