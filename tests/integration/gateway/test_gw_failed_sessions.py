"""A client leaves, or its session's worker is ejected between calls: nothing is left behind in
admission or in the dispatch gate (one_slot.py), and the session's next call is served or
refused clearly, never held."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest

from .conftest import FakeWorker
from .one_slot import Rig, one_slot
from .relay_client import CHAT, url


def _label(w: FakeWorker) -> str:
    return w.url.split("//")[1]


async def _open_stream(rig: Rig, session: str, *, final: bool) -> aiohttp.ClientResponse:
    """A stream the worker stalls after its first event; the caller reads that event."""
    h = {"x-session-id": session, "x-fake": "stall"}
    if final:
        h["x-session-final"] = "true"
    r = await rig.http.post(url(rig.g, "/v1/chat/completions"), json={**CHAT, "stream": True},
                            headers=h)
    assert r.status == 200
    assert b"w0" in await asyncio.wait_for(r.content.readuntil(b"\n\n"), 4)
    return r


@pytest.mark.parametrize("final", [False, True])
async def test_a_client_leaving_mid_stream_ends_the_call(
    fake: FakeWorker, until: Any, final: bool
) -> None:
    """The worker's request is closed; a final session's slot is free at once (not after the
    idle timeout), another session keeps its slot for its next call."""
    async with aiohttp.ClientSession() as http:
        rig = await Rig.start(one_slot([fake.url]), http)
        try:
            r = await _open_stream(rig, "leaver", final=final)
            r.close()  # the client goes away while the worker is silent
            await until(lambda: fake.cancelled == 1 and fake.active == 0)
            await rig.settled(holding={_label(fake): [] if final else ["leaver"]})
            if not final:
                assert (await rig.call("leaver", final=True)).status == 200
            await rig.serves_next()
        finally:
            await rig.stop()


@pytest.mark.parametrize("final", [False, True])
async def test_a_client_leaving_the_dispatch_gate_frees_its_place(
    fake: FakeWorker, until: Any, final: bool
) -> None:
    """A worker that runs one request at a time (``max_num_seqs: 1``, FCFS): a second session's
    call waits in the proxy's gated dispatch queue; its client leaves there. The call never
    reaches the worker, its place in the gate is gone, and once the first call ends the gate
    lets the next call through."""
    worker = {"url": fake.url, "priority": False, "max_num_seqs": 1}
    async with aiohttp.ClientSession() as http:
        rig = await Rig.start(one_slot([worker], admission={
            "window_init": 2, "window_min": 2, "window_max": 2}), http)
        try:
            first = await _open_stream(rig, "first", final=True)
            gated = asyncio.create_task(rig.call("gated", final=final))
            await until(lambda: rig.g.gateway.scheduler.core.queue_length(_label(fake)) == 1)
            gated.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gated
            core = rig.g.gateway.scheduler.core
            await until(lambda: core.queue_length(_label(fake)) == 0)
            assert core.in_flight(_label(fake)) == 1  # the first call's, still running
            assert len(fake.seen) == 1  # the gated call never went upstream
            first.close()
            await until(lambda: fake.active == 0)
            await rig.settled(holding={_label(fake): [] if final else ["gated"]})
            if not final:
                assert (await rig.call("gated", final=True)).status == 200
            await rig.serves_next()
        finally:
            await rig.stop()


async def test_a_dormant_session_moves_off_a_worker_whose_health_check_fails(
    http: aiohttp.ClientSession, until: Any
) -> None:
    """docs/reliability.md (A worker dies): after the ejection the session's next call goes to
    a healthy worker; it keeps the slot it was admitted to until it ends."""
    fakes = [await FakeWorker().start() for _ in range(2)]
    rig = await Rig.start(one_slot([f.url for f in fakes]), http)
    try:
        assert (await rig.call("agent")).status == 200
        home = next(f for f in fakes if f.seen)
        other = next(f for f in fakes if f is not home)
        await rig.settled(holding={_label(home): ["agent"]})
        home.healthy = False  # alive and answering, but its health check fails
        await until(lambda: not rig.g.gateway.health.is_healthy(home.url))
        r = await rig.call("agent")
        assert r.status == 200, r
        assert len(other.seen) == 1 and len(home.seen) == 1  # moved, not sent to the ejected
        await rig.settled(holding={_label(home): ["agent"]})  # its slot stays where admitted
        assert (await rig.call("agent", final=True)).status == 200
        assert len(other.seen) == 2
        await rig.settled()
        await rig.serves_next()
    finally:
        await rig.stop()
        for f in fakes:
            await f.stop()


async def test_a_dormant_session_whose_only_worker_is_ejected_is_refused_at_once(
    fake: FakeWorker, http: aiohttp.ClientSession, until: Any
) -> None:
    """No healthy worker: 503 ``no_healthy_worker`` with Retry-After at once, not held; the
    session keeps its slot and goes on when the worker is back."""
    rig = await Rig.start(one_slot([fake.url]), http)
    try:
        assert (await rig.call("agent")).status == 200
        fake.healthy = False
        await until(lambda: not rig.g.gateway.healthy())
        r = await rig.call("agent")
        assert r.status == 503 and r.error()["code"] == "no_healthy_worker", r
        assert int(r.headers["Retry-After"]) >= 1
        await rig.settled(holding={_label(fake): ["agent"]})
        fake.healthy = True
        await until(lambda: bool(rig.g.gateway.healthy()))
        assert (await rig.call("agent", final=True)).status == 200
        assert len(fake.seen) == 2
        await rig.serves_next()
    finally:
        await rig.stop()


@pytest.mark.parametrize("workers", [2, 1])
async def test_a_call_held_in_the_gate_of_an_ejected_worker_is_placed_anew(
    http: aiohttp.ClientSession, until: Any, workers: int
) -> None:
    """A session's call waits in its worker's dispatch gate (cap 1, another call of it running
    there) when that worker is ejected. It leaves that gate at once: to a healthy worker, or
    503 ``no_healthy_worker`` with none left. It waited for the ejected worker's running call
    to end (with a stream the worker keeps going, for as long as that runs; with a hung
    worker, up to ``upstream.idle_timeout_s``), then went to a healthy worker."""
    fakes = [await FakeWorker().start() for _ in range(workers)]
    table = [{"url": f.url, "priority": False, "max_num_seqs": 1} for f in fakes]
    rig = await Rig.start(one_slot(table), http)
    running: aiohttp.ClientResponse | None = None
    try:
        running = await _open_stream(rig, "agent", final=False)
        home = next(f for f in fakes if f.seen)
        core = rig.g.gateway.scheduler.core
        held = asyncio.create_task(rig.call("agent"))
        await until(lambda: core.queue_length(_label(home)) == 1)
        home.healthy = False  # still streaming, but its health check fails
        r = await held
        if workers == 1:
            assert r.status == 503 and r.error()["code"] == "no_healthy_worker", r
        else:
            assert r.status == 200, r
            assert [len(f.seen) for f in fakes if f is not home] == [1]
        assert core.queue_length(_label(home)) == 0 and home.active == 1
        # One call each, the rerouted one counted once (it entered two gates).
        counted = rig.g.gateway.metrics.continuations.collect().samples
        assert sum(s.value for s in counted if s.name.endswith("_total")) == 2
        running.close()
        await until(lambda: home.active == 0)
        await rig.settled(holding={_label(home): ["agent"]})
        home.healthy = True
        await until(lambda: len(rig.g.gateway.healthy()) == workers)
        assert (await rig.call("agent", final=True)).status == 200
        await rig.serves_next()
    finally:
        if running is not None:  # else the proxy's stop drains it
            running.close()
        await rig.stop()
        for f in fakes:
            await f.stop()
