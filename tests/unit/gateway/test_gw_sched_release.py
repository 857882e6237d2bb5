"""The scheduler shell times the release of a call held for a session due back: the call goes
when that wait ends (``SchedulerCore.next_release_at``), not at the next scheduler tick."""

from __future__ import annotations

import asyncio
import time

from marsproxy.config import load_config
from marsproxy.gateway.shells.service import Gateway
from marsproxy.policy.observe import WorkerObservation

URL = "http://127.0.0.1:9"


async def test_a_call_held_for_a_session_due_back_goes_when_the_wait_ends() -> None:
    cfg = load_config(environ={}, overrides={
        "policy": "mars", "workers": [{"url": URL, "name": "w0", "priority": True}],
        "scheduler": {"tuning": {"tick_s": 3600.0}},  # no tick releases it meanwhile
        "admission": {"kv_reserve_frac": 0.0}, "probes": {"nvml": {"enabled": False}},
    })
    gw = Gateway(cfg)
    gw.observe = lambda: {"w0": WorkerObservation(healthy=True, stale=False, total_blocks=100,
                                                  block_size=16, max_num_seqs=8)}
    shell, core = gw.scheduler, gw.scheduler.core
    core.yield_rank = lambda s: 1 if s.startswith("batch") else 0  # batch gives way
    core.protected_tokens = lambda w: 50 * 16  # the interactive session's forecast there
    await shell.start()  # its first tick: the worker's facts
    try:
        t0 = time.monotonic()
        b = core.arrive(t0, "batch", "w0", 30 * 16, gate=True)
        i = core.arrive(t0, "inter", "w0", 30 * 16)
        assert core.release(t0) == [b] and i.dispatched
        for t, took in ((b, 0.3), (i, 0.01)):  # batch's call took 0.3 s
            core.end(t0, t.call, ok=True, prompt_tokens=30 * 16, completion_tokens=10 * 16,
                     cached_tokens=0, engine_s=took, predicted_tool_s=None,
                     session_continues=True)
        # the interactive session, 40 blocks of context, is in its tool phase: batch's next
        # call (61 blocks) waits on the idle worker until it has been away 0.3 s
        call = asyncio.ensure_future(shell.prepare("batch", URL, {"max_tokens": 16}, b"{}",
                                                   tokens=61 * 16, body_priority=False))
        await asyncio.sleep(0.05)
        assert not call.done() and core.next_release_at() is not None
        prepared = await asyncio.wait_for(call, 5.0)
        assert prepared.ticket is not None and prepared.ticket.dispatched
        assert prepared.ticket.released_at is not None
        assert prepared.ticket.released_at >= t0 + 0.3
    finally:
        await shell.stop()
