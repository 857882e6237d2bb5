"""A held client that leaves while another request of its session waits (``_abandon``): its
request stops counting in the plane, so the session's one call leaves it dormant."""

from __future__ import annotations

import asyncio

from marsproxy.config import load_config
from marsproxy.core.answers import ReplyKind
from marsproxy.gateway.http.sse import Usage
from marsproxy.gateway.shells.admission_types import Granted
from marsproxy.gateway.shells.service import Gateway
from marsproxy.policy.observe import WorkerObservation
from marsproxy.policy.plane import Phase

URL = "http://127.0.0.1:9"


async def test_a_waiter_that_leaves_beside_another_stops_counting() -> None:
    cfg = load_config(environ={}, overrides={
        "policy": "mars", "workers": [{"url": URL, "name": "w0"}],
        "probes": {"nvml": {"enabled": False}}})
    gw = Gateway(cfg)
    seen = {"w0": WorkerObservation(healthy=True, stale=True)}  # nothing known yet: they wait
    gw.observe = lambda: seen
    shell = gw.admission
    assert shell is not None
    await shell.store.start()
    try:
        key = "anon/id/s"
        left = asyncio.ensure_future(gw.admit(key, "anon", 400, False))
        stays = asyncio.ensure_future(gw.admit(key, "anon", 400, False))
        await asyncio.sleep(0.01)
        assert not left.done() and not stays.done()
        left.cancel()  # its client went away; the other request still waits
        await asyncio.sleep(0.01)
        seen["w0"] = WorkerObservation(healthy=True, stale=False, kv_usage=0.0,
                                       total_blocks=1000, block_size=16, sampled_at=0.0)
        await shell.tick()
        granted = await asyncio.wait_for(stays, 1.0)
        assert isinstance(granted, Granted)
        gw.call_ended(key, None, ok=True, usage=Usage(100, 10, 0), engine_s=0.1,
                      continues=True, admitted=True, chars=400, reply=ReplyKind.TOOL_CALL,
                      incarnation=granted.incarnation)
        assert gw.plane.phase(key) is Phase.DORMANT
    finally:
        await shell.store.close()
