"""The gateway against scriptable fake workers: forwarding, usage handling, the session's end.

Errors, timeouts and cancellation: test_gw_relay_errors.py.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.core.identity import tenant_of
from marsproxy.gateway.http.relay import OVERHEAD_HEADER
from marsproxy.policy.outcome import Phase

from .relay_client import CHAT, config, gateway, url


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
        async with aiohttp.ClientSession() as other, other.get(url(g, "/version")) as r:
            assert r.status == 200
        assert fake.seen[-1].path_qs == "/version"
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


async def test_a_body_with_a_lone_surrogate_is_relayed_not_refused(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    """Valid JSON the proxy edits (usage asked for beside the client's stream_options) with a
    string that has no UTF-8 form: relayed with escapes, as the client wrote it."""
    g = await gateway(config([fake.url]))
    half = "half an emoji \ud83d"
    body = {**CHAT, "messages": [{"role": "user", "content": half}], "stream": True,
            "stream_options": {"continuous_usage_stats": False}}
    try:
        async with http.post(url(g, "/v1/chat/completions"), data=json.dumps(body),
                             headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200, await r.text()
            assert (await r.text()).endswith("data: [DONE]\n\n")
        sent = json.loads(fake.seen[-1].body)
        assert sent["messages"][0]["content"] == half
        assert sent["stream_options"]["include_usage"] is True
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
