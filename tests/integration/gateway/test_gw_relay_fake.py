"""The gateway against scriptable fake workers: forwarding, usage handling, errors, cancel."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.config import MarsConfig, load_config
from marsproxy.core.identity import tenant_of
from marsproxy.gateway.http.app import Running, start
from marsproxy.gateway.http.relay import OVERHEAD_HEADER
from marsproxy.policy.outcome import Phase


def config(workers: list[str], **sections: Any) -> MarsConfig:
    over: dict[str, Any] = {"workers": workers, "server": {"port": 0}}
    for k, v in sections.items():
        over[k] = {**over.get(k, {}), **v}
    return load_config(None, environ={}, overrides=over)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def gateway(cfg: MarsConfig) -> Running:
    return await start(cfg)


def url(g: Running, path: str) -> str:
    return f"http://127.0.0.1:{g.port}{path}"


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


async def error_of(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    body = await resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}
    assert OVERHEAD_HEADER in resp.headers
    return body["error"]  # type: ignore[no-any-return]


async def test_passthrough_forwards_method_query_auth_and_drops_hop_by_hop(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    g = await gateway(config([fake.url]))
    try:
        headers = {
            "Authorization": "Bearer sk-1",
            "x-custom": "v",
            "Proxy-Authorization": "p",
            "TE": "trailers",
        }
        async with http.post(url(g, "/tokenize?a=1&b=2"), data=b'{"x": 1}', headers=headers) as r:
            assert r.status == 200 and OVERHEAD_HEADER in r.headers
            got = await r.json()
        assert got == {
            "path": "/tokenize",
            "method": "POST",
            "query": "a=1&b=2",
            "body": '{"x": 1}',
        }
        seen = fake.seen[-1]
        assert seen.headers["Authorization"] == "Bearer sk-1"
        assert seen.headers["x-custom"] == "v"
        assert "Proxy-Authorization" not in seen.headers and "TE" not in seen.headers
        # Any method, on a relayed route (a stored response; see routes.py for the list).
        async with http.delete(url(g, "/v1/responses/resp_1")) as r:
            assert (await r.json())["method"] == "DELETE"
    finally:
        await g.stop()


async def test_a_workers_cookie_goes_to_its_client_and_is_never_replayed_to_others(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    # By host name, as workers usually are (aiohttp's jar would ignore an IP address's cookies).
    # /set-cookie is no inference route: the operator lists it.
    g = await gateway(config([fake.url.replace("127.0.0.1", "localhost")],
                             auth={"passthrough_routes": ["/set-cookie"]}))
    try:
        async with http.get(url(g, "/set-cookie")) as r:
            assert r.status == 200
            assert "worker_affinity=secret-of-the-first-client" in r.headers["Set-Cookie"]
        # Another client, with no cookies of its own.
        async with aiohttp.ClientSession() as other, other.get(url(g, "/v1/models")) as r:
            assert r.status == 200
        assert fake.seen[-1].path_qs == "/v1/models"
        assert "Cookie" not in fake.seen[-1].headers, fake.seen[-1].headers
    finally:
        await g.stop()


async def test_non_streaming_bytes_pass_unchanged(fake: Any, http: aiohttp.ClientSession) -> None:
    g = await gateway(config([fake.url]))
    try:
        raw = (
            b'{"model":"fake",  "messages":[{"role":"user","content":"hi"}],'
            b'"tools":[{"type":"function","function":{"name":"bash"}}],"weird":{"k":[1]}}'
        )
        async with http.post(
            url(g, "/v1/chat/completions?trace=1"),
            data=raw,
            headers={"Content-Type": "application/json"},
        ) as r:
            assert r.status == 200
            body = await r.read()
            assert float(r.headers[OVERHEAD_HEADER]) >= 0
        assert fake.seen[-1].body == raw and fake.seen[-1].path_qs == "/v1/chat/completions?trace=1"
        assert json.loads(body)["usage"]["prompt_tokens"] == 7
    finally:
        await g.stop()


async def test_stream_usage_added_upstream_and_stripped_for_client(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    g = await gateway(config([fake.url]))
    try:
        async with http.post(url(g, "/v1/chat/completions"), json={**CHAT, "stream": True}) as r:
            assert r.status == 200 and OVERHEAD_HEADER in r.headers
            text = await r.text()
        upstream_body = json.loads(fake.seen[-1].body)
        assert upstream_body["stream_options"] == {"include_usage": True}
        assert '"usage"' not in text and text.endswith("data: [DONE]\n\n")
        assert text.count("data: ") == 4  # three content chunks + [DONE]
        async with http.post(
            url(g, "/v1/chat/completions"),
            json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
        ) as r:
            text = await r.text()
        assert '"choices":[],"usage"' in text
        async with http.get(url(g, "/metrics")) as r:
            metrics = await r.text()
        assert 'marsproxy_tokens_total{kind="completion"} 6.0' in metrics
    finally:
        await g.stop()


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


async def test_messages_and_responses_relay_usage_and_chain(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    g = await gateway(config([fake.url]))
    try:
        first = {
            "model": "m",
            "system": "S",
            "stream": True,
            "messages": [{"role": "user", "content": "task"}],
        }
        async with http.post(url(g, "/v1/messages"), json=first) as r:
            raw = await r.read()
        assert raw.count(b"event: ") == 6 and b"message_delta" in raw
        assert json.loads(fake.seen[-1].body) == first  # not rewritten
        nxt = {
            **first,
            "messages": [
                *first["messages"],  # type: ignore[list-item]
                {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
                {"role": "user", "content": "next"},
            ],
        }
        async with http.post(url(g, "/v1/messages"), json=nxt) as r:
            await r.read()
        assert g.gateway.stats()["sessions"] == 1  # the continuation joined the first session

        body = {"model": "m", "instructions": "I", "input": "q", "stream": True}
        async with http.post(url(g, "/v1/responses"), json=body) as r:
            assert b"response.completed" in await r.read()
        cont = {
            **body,
            "input": [
                {"role": "user", "content": "q"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Done."}],
                },
                {"role": "user", "content": "more"},
            ],
        }
        async with http.post(url(g, "/v1/responses"), json=cont) as r:
            await r.read()
        assert g.gateway.stats()["sessions"] == 2
        async with http.get(url(g, "/metrics")) as r:
            metrics = await r.text()
        assert 'marsproxy_tokens_total{kind="prompt"} 48.0' in metrics  # 11 + 11 + 13 + 13
        assert 'marsproxy_requests_total{code="200",route="messages"} 2.0' in metrics
    finally:
        await g.stop()


async def test_admin_endpoints_and_final_flag(fake: Any, http: aiohttp.ClientSession) -> None:
    g = await gateway(config([fake.url]))
    try:
        for path in ("/healthz", "/readyz", "/metrics"):
            async with http.get(url(g, path)) as r:
                assert r.status == 200 and OVERHEAD_HEADER in r.headers
        async with http.post(
            url(g, "/v1/chat/completions"), json=CHAT, headers={"x-session-id": "s"}
        ) as r:
            assert r.status == 200
        assert g.gateway.stats()["sessions"] == 1
        async with http.post(
            url(g, "/v1/chat/completions"),
            json=CHAT,
            headers={"x-session-id": "s", "x-session-final": "true"},
        ) as r:
            assert r.status == 200
        assert g.gateway.stats()["sessions"] == 0
        assert g.gateway.stats()["session_workers"] == {}
        async with http.get(url(g, "/metrics")) as r:
            text = await r.text()
        # No session id or key ever becomes a label (name or value).
        labels = [(k, v) for fam in text_string_to_metric_families(text)
                  for smp in fam.samples for k, v in smp.labels.items()]
        assert labels and not any("session" in k for k, _ in labels)
        assert not any(v == "s" or "/id/" in v for _, v in labels), labels
    finally:
        await g.stop()


async def test_a_reply_of_the_wrong_shape_reaches_the_client_and_the_session_goes_on(
    fake: Any, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    # Usage is read after the reply has left: a reply it cannot read is the client's as it
    # came, a warning names it, and the call ends all the same (no slot kept). Without a
    # session id the proxy also reads the reply (chain matching).
    g = await gateway(config([fake.url]))
    try:
        for headers in ({"x-session-id": "odd-1", "x-session-final": "true"}, {}):
            async with http.post(url(g, "/v1/chat/completions"), json=CHAT,
                                 headers={**headers, "x-fake": "odd"}) as r:
                assert r.status == 200
                assert (await r.json())["choices"] == 5
        # Usage of the wrong shape reads as none; the chain's reply could not be read at all.
        assert caplog.text.count("no usage read from it") == 1
        assert g.gateway.sessions.get(f"{tenant_of(None)}/id/odd-1") is None  # it ended
        [chain] = g.gateway.sessions.keys()  # the one without an id goes on, out of its call
        assert g.gateway.plane.phase(chain) is Phase.DORMANT
    finally:
        await g.stop()


def _overhead_sum(page: str, route: str) -> float:
    return next(s.value for f in text_string_to_metric_families(page) for s in f.samples
                if s.name == "marsproxy_proxy_overhead_seconds_sum"
                and s.labels.get("route") == route)


async def test_a_response_leaves_before_the_session_end_and_the_header_counts_up_to_it(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    # Defaults (mars policy, admission on); a one-call session with the final flag: its end
    # (admission, session table, session_end) runs right after the response has left, so the
    # client does not wait for it. The header says the proxy's time until the response left;
    # the histogram adds the after-work.
    g = await gateway(config([fake.url]))
    try:
        final = {"x-session-id": "one-call-1", "x-session-final": "true"}
        async with http.post(url(g, "/v1/chat/completions"), json=CHAT, headers=final) as r:
            assert r.status == 200
            sent_ms = float(r.headers[OVERHEAD_HEADER])
            await r.read()
        async with http.get(url(g, "/metrics")) as r:
            observed_ms = _overhead_sum(await r.text(), "chat") * 1000
        assert sent_ms > 0
        assert observed_ms > sent_ms  # the session's end counted, after the header was sent
        # Done before the proxy handled anything else: the session is gone by the next request.
        assert g.gateway.sessions.get(f"{tenant_of(None)}/id/one-call-1") is None

        # A stream's header leaves before its body: the histogram also has the work after it.
        stream = {**CHAT, "stream": True}
        headers = {"x-session-id": "one-call-2", "x-session-final": "true"}
        async with http.post(url(g, "/v1/chat/completions"), json=stream, headers=headers) as r:
            await r.read()
            streamed_ms = float(r.headers[OVERHEAD_HEADER])
        async with http.get(url(g, "/metrics")) as r:
            both_ms = _overhead_sum(await r.text(), "chat") * 1000
        assert both_ms - observed_ms > streamed_ms
    finally:
        await g.stop()
