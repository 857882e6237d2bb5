"""Client input the proxy reads but vLLM judges: odd shapes inside a body's messages are the
worker's to refuse (the proxy relays them, never a 500), and a body that does not decode ends
its connection, so the client's next request is not lost on it."""

from __future__ import annotations

import gzip
import json
from typing import Any

import aiohttp
import pytest

from marsproxy.gateway.http.app import Running

from .telemetry_client import url

DEEP = "[" * 100_000 + "]" * 100_000
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "fake", "messages": [
        {"role": "assistant", "tool_calls": 5}, {"role": "user", "content": "x"}]}),
    ("/v1/chat/completions", {"model": "fake", "messages": [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "a", "arguments": DEEP}}]}]}),
    ("/v1/messages", {"model": "fake", "max_tokens": 5, "messages": [
        {"role": "user", "content": "x"}], "metadata": {"user_id": '{"a":' + DEEP + "}"}}),
    ("/v1/responses", {"model": "fake", "input": [
        {"type": "function_call", "name": "a", "arguments": DEEP}]}),
])
async def test_odd_message_shapes_are_relayed_not_a_500(
    gw: Running, http: aiohttp.ClientSession, fake: Any, path: str, body: dict[str, Any]
) -> None:
    async with http.post(url(gw, path), json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()
    assert json.loads(fake.seen[-1].body) == body


async def test_bodies_nested_to_the_parsers_limit_are_never_a_500(
    gw: Running, http: aiohttp.ClientSession
) -> None:
    # Around the parser's limit (the exact depth depends on the stack): parsed, then written
    # again (stream_options merged) or canonicalized (a message that is not an object).
    for depth in range(900, 1000):
        nest = "[" * depth + "]" * depth
        for raw in (
            '{"model":"fake","stream":true,"stream_options":{"x":1},'
            '"messages":[{"role":"user","content":"x"}],"extra":' + nest + "}",
            '{"model":"fake","messages":[' + nest + "]}",
        ):
            async with http.post(url(gw, "/v1/chat/completions"), data=raw.encode(),
                                 headers={"Content-Type": "application/json"}) as r:
                assert r.status != 500, (depth, await r.text())
                await r.read()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize",
                                  "/mars/v1/sessions/nope/events"])
async def test_a_body_that_does_not_decode_closes_its_connection(
    gw: Running, path: str
) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        async with http.post(url(gw, path), data=b"not gzip", headers={
                "Content-Encoding": "gzip", "Content-Type": "application/json"}) as r:
            assert r.status in (400, 404)
            assert r.headers.get("Connection", "").lower() == "close"
            assert (await r.json())["error"]["code"] in ("invalid_body", "session_not_found")
        # The same client's next request (a pooled connection) is served.
        good = gzip.compress(json.dumps(CHAT).encode())
        async with http.post(url(gw, "/v1/chat/completions"), data=good, headers={
                "Content-Encoding": "gzip", "Content-Type": "application/json"}) as r:
            assert r.status == 200, await r.text()
