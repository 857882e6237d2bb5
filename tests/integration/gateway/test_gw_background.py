"""Background Responses through the gateway over real sockets (``shells/background.py``): the
call of a response answered ``queued`` stays open while the worker generates it and ends with
it: on the proxy's own poll, at once after the client's poll or cancel passes through, when the
worker no longer knows it or stops answering, past ``upstream.first_byte_timeout_s``, or when
the proxy stops.
Workers: ``responses_worker.StoringWorker`` (vLLM with its response store on)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from marsproxy.core.identity import tenant_of
from marsproxy.gateway.http.app import Running
from marsproxy.policy.plane import Phase

from .relay_client import config, gateway, url
from .responses_worker import StoringWorker

TOOLS = [{"type": "function", "name": "run", "parameters": {"type": "object"}}]


def _phase(g: Running, session: str) -> Phase:
    return g.gateway.plane.phase(f"{tenant_of(None)}/id/{session}")


async def _post(http: aiohttp.ClientSession, g: Running, session: str, fake: str,
                **extra: Any) -> dict[str, Any]:
    async with http.post(url(g, "/v1/responses"), headers={
            "x-session-id": session, "x-fake": fake},
            json={"model": "fake", "input": "go", "tools": TOOLS, **extra}) as r:
        assert r.status == 200, await r.text()
        out: dict[str, Any] = await r.json()
        return out


@contextlib.asynccontextmanager
async def _streamed(http: aiohttp.ClientSession, g: Running,
                    session: str) -> AsyncIterator[aiohttp.ClientResponse]:
    """A streamed background call of a tool-calling session, its first event (created) read."""
    async with http.post(url(g, "/v1/responses"), headers={"x-session-id": session,
                                                            "x-fake": "tool"},
                         json={"model": "fake", "input": "go", "tools": TOOLS,
                               "background": True, "stream": True}) as r:
        assert r.status == 200
        await r.content.readuntil(b"\n\n")
        yield r


def _polls(w: StoringWorker, rid: str) -> int:
    return sum(s.method == "GET" and s.path_qs == f"/v1/responses/{rid}" for s in w.seen)


async def _open_calls(http: aiohttp.ClientSession, g: Running) -> float:
    async with http.get(url(g, "/metrics")) as r:
        text = await r.text()
    return float(next(line.split()[1] for line in text.splitlines()
                      if line.startswith("marsproxy_background_calls ")))


@contextlib.asynccontextmanager
async def _proxy(two: list[StoringWorker],
                 **sections: Any) -> AsyncIterator[tuple[Running, StoringWorker]]:
    """A gateway in front of the first storing worker, stopped at the end."""
    g = await gateway(config([two[0].url], **sections))
    try:
        yield g, two[0]
    finally:
        await g.stop()


async def test_the_call_stays_open_until_the_worker_ends_it_and_its_answer_ends_the_session(
    two: list[StoringWorker], http: aiohttp.ClientSession, until: Any
) -> None:
    """``background: true``: vLLM answers ``queued`` at once and generates after. That is no
    answer and no end of the call: admission sees the session in a call while the engine works;
    the final response, read when the proxy's poll finds it, is the answer that ends it."""
    async with _proxy(two, health={"interval_s": 0.05}) as (g, w):
        await _post(http, g, "bg", "tool")  # this key's replies call tools
        reply = await _post(http, g, "bg", "ok", background=True)
        rid = reply["id"]
        await until(lambda: _polls(w, rid) >= 3)  # polled, still generating
        assert reply["status"] == "queued"
        assert _phase(g, "bg") is Phase.IN_CALL
        assert await _open_calls(http, g) == 1.0
        w.finish(rid)
        await until(lambda: _phase(g, "bg") is Phase.ENDED)  # the answer ended it
        assert await _open_calls(http, g) == 0.0
        polls = _polls(w, rid)
        await asyncio.sleep(0.3)
        assert _polls(w, rid) == polls  # no poll after its end


async def test_a_finished_background_calls_usage_is_counted_and_its_session_goes_on(
    two: list[StoringWorker], http: aiohttp.ClientSession, until: Any
) -> None:
    async def prompt_tokens(g: Running) -> str:
        async with http.get(url(g, "/metrics")) as r:
            text = await r.text()
        return next((line for line in text.splitlines()
                     if line.startswith('marsproxy_tokens_total{kind="prompt"}')), "none")

    async with _proxy(two, health={"interval_s": 0.05}) as (g, w):
        rid = (await _post(http, g, "t", "tool", background=True))["id"]
        await until(lambda: _polls(w, rid) >= 1)
        assert await prompt_tokens(g) == "none"  # the queued reply carried no usage
        w.finish(rid)
        await until(lambda: _phase(g, "t") is Phase.DORMANT)  # a tool call: it comes back
        assert await prompt_tokens(g) == 'marsproxy_tokens_total{kind="prompt"} 5.0'


async def test_the_clients_own_poll_through_the_proxy_ends_the_call_at_once(
    two: list[StoringWorker], http: aiohttp.ClientSession, until: Any
) -> None:
    # The proxy's own poll: far off.
    async with _proxy(two, health={"interval_s": 30}) as (g, w):
        rid = (await _post(http, g, "p", "tool", background=True))["id"]
        w.finish(rid)
        async with http.get(url(g, f"/v1/responses/{rid}")) as r:
            assert r.status == 200
            assert (await r.json())["status"] == "completed"
        await until(lambda: _phase(g, "p") is Phase.DORMANT, within=3)
        assert _polls(w, rid) == 2  # the client's, then the proxy's


async def test_a_cancelled_background_response_ends_its_call(
    two: list[StoringWorker], http: aiohttp.ClientSession, until: Any
) -> None:
    async with _proxy(two, health={"interval_s": 30}) as (g, w):
        rid = (await _post(http, g, "c", "tool", background=True))["id"]
        assert _phase(g, "c") is Phase.IN_CALL
        async with http.post(url(g, f"/v1/responses/{rid}/cancel")) as r:
            assert r.status == 200
            assert (await r.json())["status"] == "cancelled"
        await until(lambda: _phase(g, "c") is not Phase.IN_CALL, within=3)
        assert len(g.gateway.background) == 0
        assert rid not in w.running


async def test_a_response_the_worker_no_longer_keeps_ends_its_call(
    two: list[StoringWorker], http: aiohttp.ClientSession, until: Any
) -> None:
    async with _proxy(two, health={"interval_s": 0.05}) as (g, w):
        rid = (await _post(http, g, "f", "tool", background=True))["id"]
        await until(lambda: _polls(w, rid) >= 1)
        assert _phase(g, "f") is Phase.IN_CALL
        w.forget(rid)  # the worker restarted: its store is gone
        await until(lambda: _phase(g, "f") is not Phase.IN_CALL)


async def test_a_worker_that_stops_answering_ends_its_background_calls(
    two: list[StoringWorker], http: aiohttp.ClientSession, until: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with _proxy(two, health={"interval_s": 0.05, "unhealthy_after": 3}) as (g, w):
        with caplog.at_level(logging.WARNING, "marsproxy.gateway.shells.background"):
            rid = (await _post(http, g, "d", "tool", background=True))["id"]
            await until(lambda: _polls(w, rid) >= 2)
            assert _phase(g, "d") is Phase.IN_CALL  # answered: still generating
            await w.stop()  # the worker is gone: no answer any more
            await until(lambda: _phase(g, "d") is not Phase.IN_CALL)
        assert any("did not answer 3 times" in r.getMessage() for r in caplog.records)


async def test_a_response_unfinished_past_the_first_byte_timeout_ends_its_call(
    two: list[StoringWorker], http: aiohttp.ClientSession, until: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with _proxy(two, health={"interval_s": 0.05},
                        upstream={"first_byte_timeout_s": 0.3}) as (g, w):
        with caplog.at_level(logging.WARNING, "marsproxy.gateway.shells.background"):
            rid = (await _post(http, g, "x", "tool", background=True))["id"]
            await until(lambda: _phase(g, "x") is not Phase.IN_CALL)
        assert rid in w.running  # the worker still generates; the proxy stopped waiting
        assert any("upstream.first_byte_timeout_s" in r.getMessage() for r in caplog.records)


async def test_the_proxy_stopping_ends_every_open_background_call(
    two: list[StoringWorker], http: aiohttp.ClientSession
) -> None:
    async with _proxy(two, health={"interval_s": 30}) as (g, w):
        rid = (await _post(http, g, "s", "tool", background=True))["id"]
        assert _phase(g, "s") is Phase.IN_CALL
    assert len(g.gateway.background) == 0
    assert _phase(g, "s") is not Phase.IN_CALL  # no call held open by a proxy that is gone
    assert rid in w.running


async def test_a_streamed_background_response_whose_client_left_is_watched_to_its_end(
    two: list[StoringWorker], http: aiohttp.ClientSession, until: Any
) -> None:
    """vLLM goes on with a background response whose streaming client left: so does its call,
    until the worker's response has ended (then with its usage)."""
    async with _proxy(two, health={"interval_s": 0.05}) as (g, w):
        async with _streamed(http, g, "gone") as r:
            r.close()  # the client leaves mid-stream
        rid = w.made[-1]
        await until(lambda: _polls(w, rid) >= 2)  # the proxy asks after it
        assert rid in w.running and _phase(g, "gone") is Phase.IN_CALL
        w.finish(rid)
        await until(lambda: _phase(g, "gone") is Phase.DORMANT)
        assert len(g.gateway.background) == 0


async def test_a_streamed_background_response_ends_its_call_with_the_stream(
    two: list[StoringWorker], http: aiohttp.ClientSession, until: Any
) -> None:
    """With ``stream: true`` the stream carries the whole generation: nothing to poll."""
    async with _proxy(two, health={"interval_s": 0.05}) as (g, w):
        async with _streamed(http, g, "st") as r:
            w.finish(w.made[-1])
            await r.read()
        await until(lambda: _phase(g, "st") is Phase.DORMANT)
        assert len(g.gateway.background) == 0
        assert _polls(w, w.made[-1]) == 0
