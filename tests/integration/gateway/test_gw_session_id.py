"""``probes.kv_events.session_id``: the proxy's session key goes into the relayed body's
``session_id`` (so the workers' KV events name the session) when some worker has ``kv_events``
(auto) or always; otherwise bodies pass unchanged. A worker whose publisher is dead is served
as usual and shows an index that is not usable."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from marsproxy.config import load_config
from marsproxy.gateway.http.app import start


async def _relayed(fake: Any, http: aiohttp.ClientSession, worker: dict[str, Any],
                   mode: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The body the worker received, and the state document after the call."""
    cfg = load_config(None, environ={}, overrides={
        "workers": [worker], "server": {"port": 0},
        "probes": {"kv_events": {"session_id": mode}}})
    g = await start(cfg)
    try:
        async with http.post(f"http://127.0.0.1:{g.port}/v1/chat/completions", json=body,
                             headers={"x-session-id": "s1"}) as r:
            assert r.status == 200, await r.text()
            await r.read()
        async with http.get(f"http://127.0.0.1:{g.port}/mars/v1/state") as r:
            state = await r.json()
    finally:
        await g.stop()
    return json.loads(fake.seen[-1].body), state


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


async def test_auto_without_kv_events_leaves_the_body_alone(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    sent, state = await _relayed(fake, http, {"url": fake.url}, "auto", CHAT)
    assert "session_id" not in sent and "kv_index" not in state


async def test_always_sets_the_proxys_key_replacing_the_clients(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    sent, _ = await _relayed(fake, http, {"url": fake.url}, "always",
                             {**CHAT, "session_id": "client-chosen"})
    assert sent["session_id"] == "anon/id/s1" and sent["messages"] == CHAT["messages"]


async def test_auto_with_a_dead_publisher_sets_it_and_serves_as_usual(
    fake: Any, http: aiohttp.ClientSession, dead_url: str
) -> None:
    port = dead_url.rsplit(":", 1)[1]
    worker = {"url": fake.url, "name": "w", "kv_events": {"endpoint": f"tcp://127.0.0.1:{port}"}}
    sent, state = await _relayed(fake, http, worker, "auto", CHAT)
    assert sent["session_id"] == "anon/id/s1"
    kv = state["kv_index"]["w"]
    assert not kv["connected"] and not kv["usable"] and kv["blocks"] == {}
    sent, _ = await _relayed(fake, http, worker, "never", CHAT)
    assert "session_id" not in sent
