"""A session deleted while one of its calls runs, its id reused at once: the old call's end
is the old session's. The new session stays in its own call until that call ends."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from marsproxy.emulator.server import EmulatorOptions, create_app
from marsproxy.policy.plane import Phase

_Factory = Any


class _HeldCalls:
    """An emulated worker that holds each chat call whose prompt is one of ``tags`` until
    the test lets it go."""

    def __init__(self, *tags: str) -> None:
        self.arrived = {t: asyncio.Event() for t in tags}
        self.go = {t: asyncio.Event() for t in tags}

    def app(self) -> web.Application:
        app = create_app(EmulatorOptions(profile="tiny", time_scale=0.05))

        @web.middleware
        async def hold(request: web.Request,
                       handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                       ) -> web.StreamResponse:
            if request.path == "/v1/chat/completions":
                tag = (await request.json())["messages"][-1]["content"]
                if tag in self.go:
                    self.arrived[tag].set()
                    await self.go[tag].wait()
            return await handler(request)

        app.middlewares.append(hold)
        return app


async def _row(s: Any, sid: str) -> dict[str, Any]:
    async with s.http.get(s.url("/mars/v1/state?sessions=1")) as r:
        assert r.status == 200
        doc = await r.json()
    rows = [d for d in doc["sessions"]["details"] if d["id"] == sid]
    assert len(rows) == 1, doc["sessions"]
    return {"state": rows[0]["state"], "llm": doc["sessions"]["by_state"]["llm"]}


async def test_the_end_of_a_deleted_sessions_call_leaves_the_reused_id_in_its_own_call(
    make_stack: _Factory,
) -> None:
    worker = _HeldCalls("old", "new")
    s = await make_stack(window=4, app=worker.app)
    plane = s.proxy.gateway.plane
    old = asyncio.create_task(s.chat("x", content="old"))
    await asyncio.wait_for(worker.arrived["old"].wait(), 10)
    async with s.http.delete(s.url("/mars/v1/sessions/x")) as r:  # while its call runs
        assert r.status == 200
    new = asyncio.create_task(s.chat("x", content="new"))  # the id reused at once
    await asyncio.wait_for(worker.arrived["new"].wait(), 10)
    worker.go["old"].set()
    assert (await asyncio.wait_for(old, 10))[0] == 200  # the old session's call is over
    assert await _row(s, "x") == {"state": "llm", "llm": 1}  # the new one's still runs
    assert plane.phase("anon/id/x") is Phase.IN_CALL
    worker.go["new"].set()
    assert (await asyncio.wait_for(new, 10))[0] == 200
    assert (await _row(s, "x"))["llm"] == 0
    assert plane.phase("anon/id/x") is Phase.DORMANT
