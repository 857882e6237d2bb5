"""The gateway against scriptable fake workers: errors (bad requests, upstream errors, connect
failures, no healthy worker, timeouts) and cancellation when the client goes away."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from marsproxy.gateway.http.relay import OVERHEAD_HEADER
from marsproxy.gateway.http.sse import SSEFilter
from marsproxy.gateway.shells.outcome import RequestEvents

from .relay_client import CHAT, config, gateway, url


async def error_of(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    body = await resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert OVERHEAD_HEADER in resp.headers
    return body["error"]  # type: ignore[no-any-return]


async def test_bad_requests(fake: Any, http: aiohttp.ClientSession) -> None:
    g = await gateway(config([fake.url], server={"max_body_bytes": 1000}))
    try:
        for data in (b"{nope", b"[1,2]"):
            async with http.post(url(g, "/v1/chat/completions"), data=data) as r:
                assert r.status == 400
                assert (await error_of(r))["type"] == "invalid_request_error"
        async with http.post(url(g, "/v1/completions"), data=b"x" * 2000) as r:
            assert r.status == 413
            assert (await error_of(r))["code"] == "body_too_large"
        assert fake.seen == []
    finally:
        await g.stop()


async def test_upstream_error_passes_through(fake: Any, http: aiohttp.ClientSession) -> None:
    g = await gateway(config([fake.url]))
    try:
        async with http.post(
            url(g, "/v1/chat/completions"), json={**CHAT, "stream": True}, headers={"x-fake": "404"}
        ) as r:
            assert r.status == 404
            assert (await r.json())["error"]["message"] == "The model `nope` does not exist."
    finally:
        await g.stop()


async def test_connect_failure_retries_once_then_502(
    fake: Any, http: aiohttp.ClientSession, dead_url: str
) -> None:
    g = await gateway(config([dead_url, fake.url], health={"interval_s": 60}))
    try:
        # The first session is placed on the dead worker (config order) and moved on connect.
        async with http.post(
            url(g, "/v1/chat/completions"), json=CHAT, headers={"x-session-id": "s1"}
        ) as r:
            assert r.status == 200
        assert g.gateway.stats()["session_workers"] == {"anon/id/s1": fake.url.split("//")[1]}
    finally:
        await g.stop()
    g = await gateway(config([dead_url], health={"interval_s": 60}))
    try:
        async with http.post(url(g, "/v1/chat/completions"), json=CHAT) as r:
            assert r.status == 502
            assert (await error_of(r))["code"] == "upstream_connect_failed"
        async with http.get(url(g, "/metrics")) as r:
            assert 'kind="connect"' in await r.text()
    finally:
        await g.stop()


async def test_no_healthy_worker_is_503_with_retry_after(
    http: aiohttp.ClientSession, dead_url: str, until: Any
) -> None:
    g = await gateway(config([dead_url], health={"interval_s": 0.05, "unhealthy_after": 1}))
    try:
        async with http.get(url(g, "/healthz")) as r:
            assert r.status == 200
        await until(lambda: not g.gateway.healthy())
        async with http.get(url(g, "/readyz")) as r:
            assert r.status == 503
        async with http.post(url(g, "/v1/chat/completions"), json=CHAT) as r:
            assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
            assert (await error_of(r))["code"] == "no_healthy_worker"
        async with http.get(url(g, "/metrics")) as r:
            assert "marsproxy_worker_healthy" in (text := await r.text())
            assert 'code="503"' in text
    finally:
        await g.stop()


async def test_first_byte_timeout_is_504(
    fake: Any, http: aiohttp.ClientSession, until: Any
) -> None:
    g = await gateway(config([fake.url], upstream={"first_byte_timeout_s": 0.2}))
    try:
        async with http.post(
            url(g, "/v1/chat/completions"),
            json={**CHAT, "stream": True},
            headers={"x-fake": "hang"},
        ) as r:
            assert r.status == 504
            assert (await error_of(r))["code"] == "upstream_timeout"
            # The 200 ms spent waiting on the worker is not the proxy's overhead.
            assert float(r.headers[OVERHEAD_HEADER]) < 100
        await until(lambda: fake.active == 0)  # the hung upstream request was abandoned
    finally:
        await g.stop()


async def test_idle_timeout_mid_stream_ends_with_sse_error(
    fake: Any, http: aiohttp.ClientSession, until: Any
) -> None:
    g = await gateway(config([fake.url], upstream={"idle_timeout_s": 0.2}))
    try:
        async with http.post(
            url(g, "/v1/chat/completions"),
            json={**CHAT, "stream": True},
            headers={"x-fake": "stall"},
        ) as r:
            assert r.status == 200
            text = await r.text()
        events = [e for e in text.split("\n\n") if e]
        assert '"w0 "' in events[0]
        assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "upstream_timeout"
        await until(lambda: fake.cancelled == 1)
    finally:
        await g.stop()


async def test_a_failure_of_ours_mid_stream_ends_it_with_an_sse_error(
    fake: Any, http: aiohttp.ClientSession, until: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in the proxy's own handling of a stream whose headers have left: the client gets
    an SSE error event and a well-framed end (a 500 written then landed inside the open stream:
    the client read a protocol error), the worker's request stops, and the final call still
    ends its session."""
    g = await gateway(config([fake.url]))
    fed = {"n": 0}
    real = SSEFilter.feed

    def fails_second(self: SSEFilter, chunk: bytes) -> bytes:
        fed["n"] += 1
        if fed["n"] == 2:
            raise RuntimeError("a bug in the stream's handling")
        return real(self, chunk)

    monkeypatch.setattr(SSEFilter, "feed", fails_second)
    try:
        async with http.post(
            url(g, "/v1/chat/completions"), json={**CHAT, "stream": True},
            headers={"x-fake": "slow", "x-session-id": "s", "x-session-final": "true"},
        ) as r:
            assert r.status == 200
            text = await asyncio.wait_for(r.text(), 10)  # a clean end: no payload error
        last = json.loads([e for e in text.split("\n\n") if e][-1].removeprefix("data: "))
        assert last["error"]["code"] == "internal_error"
        await until(lambda: fake.cancelled == 1)
        await until(lambda: g.gateway.plane.held("anon/id/s") is None)
    finally:
        await g.stop()


async def test_client_disconnect_cancels_upstream(fake: Any, until: Any) -> None:
    g = await gateway(config([fake.url]))
    try:
        async with aiohttp.ClientSession() as http:
            r = await http.post(
                url(g, "/v1/chat/completions"),
                json={**CHAT, "stream": True},
                headers={"x-fake": "stall"},
            )
            assert b"w0" in await r.content.readuntil(b"\n\n")
            assert fake.active == 1
            r.close()  # the client goes away while the worker is silent
        await until(lambda: fake.cancelled == 1 and fake.active == 0)
        async with aiohttp.ClientSession() as http:  # a waiting non-streamed request too
            task = http.post(
                url(g, "/v1/chat/completions"),
                json=CHAT,
                headers={"x-fake": "hang"},
                timeout=aiohttp.ClientTimeout(total=0.3),
            )
            with pytest.raises(TimeoutError):
                await task
        await until(lambda: fake.cancelled == 2 and fake.active == 0)
    finally:
        await g.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_failed_accounting_still_ends_the_call(
    fake: Any, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, stream: bool,
) -> None:
    """A bug in the accounting after a response costs a log line, never the session's slot:
    the final call still ends its session and releases what admission held for it."""
    g = await gateway(config([fake.url]))

    def broken(*_: Any) -> None:
        raise RuntimeError("accounting bug")

    monkeypatch.setattr(RequestEvents, "ended", broken)
    worker = fake.url.split("//")[1]
    try:
        for i in range(3):
            async with http.post(
                url(g, "/v1/chat/completions"), json={**CHAT, "stream": stream},
                headers={"x-session-id": f"s{i}", "x-session-final": "true"},
            ) as r:
                assert r.status == 200
                assert "w2" in await r.text()  # the client has its whole reply
            assert g.gateway.plane.held(f"anon/id/s{i}") is None
        assert g.gateway.plane.held_on(worker) == 0
        failures = [r for r in caplog.records if "accounting of a chat request" in r.message]
        assert len(failures) == 3 and failures[0].exc_info is not None
    finally:
        await g.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_negative_token_counts_still_end_the_call(
    fake: Any, http: aiohttp.ClientSession, until: Any, stream: bool,
) -> None:
    """A worker whose usage holds negative counts (a broken engine or shim) fails the token
    counters (a Prometheus counter refuses them), never the end of the call: the session
    leaves its call, and its final call ends it and releases its admission slot."""
    g = await gateway(config([fake.url]))
    gw, key = g.gateway, "anon/id/neg"
    try:
        for final in ("false", "false", "true"):  # the second call resumes: resume counters
            async with http.post(
                url(g, "/v1/chat/completions"), json={**CHAT, "stream": stream},
                headers={"x-session-id": "neg", "x-session-final": final, "x-fake": "negative"},
            ) as r:
                assert r.status == 200
                assert "w2" in await r.text()
            if final == "false":
                await until(lambda: (s := gw.sessions.get(key)) is not None and not s.in_flight)
        await until(lambda: gw.sessions.get(key) is None)
        assert gw.plane.held(key) is None and gw.plane.held_on(fake.url.split("//")[1]) == 0
    finally:
        await g.stop()


async def test_a_reply_nested_too_deeply_still_counts_the_request_out(
    fake: Any, http: aiohttp.ClientSession, until: Any,
) -> None:
    """A JSON reply nested deeper than the stack (a broken worker) yields no usage, and the
    request leaves the in-flight counts (its own gauge and its worker's) all the same."""
    g = await gateway(config([fake.url]))
    gw = g.gateway
    try:
        async with http.post(url(g, "/v1/chat/completions"), json=CHAT,
                             headers={"x-session-id": "deep", "x-fake": "deep"}) as r:
            assert r.status == 200
            await r.read()
        await until(lambda: not gw.sessions.get("anon/id/deep").in_flight)  # the call ended
        assert gw.metrics.in_flight.value == 0 and gw.in_flight_by_worker[fake.url] == 0
    finally:
        await g.stop()


async def test_a_failed_round_of_health_checks_does_not_stop_them(
    fake: Any, until: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = await gateway(config([fake.url], health={"interval_s": 0.05}))
    health, rounds = g.gateway.checker, []
    real = health.check_all

    async def fails_once(session: Any) -> None:
        rounds.append(1)
        if len(rounds) == 1:
            raise RuntimeError("a bug in a round of checks")
        await real(session)

    monkeypatch.setattr(health, "check_all", fails_once)
    try:
        await until(lambda: len(rounds) >= 3)  # the loop lived on
    finally:
        await g.stop()
