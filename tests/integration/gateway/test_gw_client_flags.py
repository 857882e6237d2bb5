"""Flags a client sends that the proxy reads itself: the final header (an unreadable value is
refused before the request takes anything) and the body's ``stream`` (read as vLLM reads it)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from .relay_client import CHAT, config, gateway, url

ONE_SLOT = {"window_init": 1, "window_min": 1, "window_max": 1}


async def test_an_unreadable_final_flag_is_400_before_any_slot_or_session(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    g = await gateway(config([fake.url], admission=ONE_SLOT))
    try:
        async with http.post(url(g, "/v1/chat/completions"), json=CHAT, headers={
                "x-session-id": "f1", "x-session-final": "maybe"}) as r:
            assert r.status == 400
            err = (await r.json())["error"]
            assert r.headers["x-marsproxy-reason"] == err["code"] == "invalid_final_flag"
        assert err["type"] == "invalid_request_error"
        assert "x-session-final" in err["message"] and "'maybe'" in err["message"]
        assert "true/false, 1/0, yes/no, on/off" in err["message"]
        assert fake.seen == []  # nothing went upstream
        async with http.get(url(g, "/mars/v1/state")) as r:
            assert (await r.json())["sessions"]["total"] == 0
        # The only admission slot is free: another session is served at once, not queued.
        post = http.post(url(g, "/v1/chat/completions"), json=CHAT,
                         headers={"x-session-id": "f2", "x-session-final": "TRUE"})
        async with asyncio.timeout(10), post as r:
            assert r.status == 200, await r.text()
    finally:
        await g.stop()


@pytest.mark.parametrize("flag", ["true", "True", "yes", "on", "t", "y", "1", 1, 1.0])
async def test_a_stream_flag_vllm_reads_as_true_gets_its_usage_counted(
    fake: Any, http: aiohttp.ClientSession, flag: Any
) -> None:
    """vLLM reads ``stream`` as pydantic's lax bool ("true", 1, ...) and streams: the proxy
    asks for the usage chunk, counts it and drops it for the client, as for ``true``."""
    g = await gateway(config([fake.url]))
    try:
        async with http.post(url(g, "/v1/chat/completions"), json={**CHAT, "stream": flag},
                             headers={"x-session-id": "s1"}) as r:
            assert r.status == 200
            text = await r.text()
        assert json.loads(fake.seen[-1].body)["stream_options"] == {"include_usage": True}
        assert '"usage"' not in text and text.endswith("data: [DONE]\n\n")
        async with http.get(url(g, "/metrics")) as r:
            assert 'marsproxy_tokens_total{kind="completion"} 3.0' in await r.text()
    finally:
        await g.stop()


async def test_include_usage_as_vllm_reads_it_is_the_clients_own(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    """``"include_usage": "true"`` is the client asking for usage (vLLM reads it so): its usage
    chunk reaches it."""
    g = await gateway(config([fake.url]))
    try:
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": "true"}}
        async with http.post(url(g, "/v1/chat/completions"), json=body) as r:
            assert r.status == 200
            assert '"choices":[],"usage"' in await r.text()
    finally:
        await g.stop()
