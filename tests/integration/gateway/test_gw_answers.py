"""A session ends on its answer, through the gateway over real sockets: a reply that calls no
tool ends the session of a key whose replies call tools (core/answers.py); a key whose replies
never did keeps its sessions until they idle. Workers: the scriptable fake of conftest.py."""

from __future__ import annotations

from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.gateway.http.app import Running

from .telemetry_client import AUTH, CHAT, Events, state, url

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]


async def _call(http: aiohttp.ClientSession, gw: Running, session: str, *, tool: bool,
                stream: bool, auth: dict[str, str] = AUTH, offer: bool = True) -> None:
    """``tool``: the fake's reply calls a tool; ``offer``: the request carries tools (an agent
    loop's call; a harness's side request carries none)."""
    headers = {**auth, "x-session-id": session}  # never a final flag
    if tool:
        headers["x-fake"] = "tool"
    body = {**CHAT, "stream": stream, **({"tools": TOOLS} if offer else {})}
    async with http.post(url(gw, "/v1/chat/completions"), json=body, headers=headers) as r:
        assert r.status == 200
        await r.read()


async def _ended(http: aiohttp.ClientSession, gw: Running, reason: str) -> float:
    async with http.get(url(gw, "/metrics")) as r:
        text = await r.text()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if (s.name == "marsproxy_session_duration_seconds_count"
                    and s.labels.get("reason") == reason):
                return s.value
    return 0.0


async def test_the_answer_ends_a_tool_calling_session(gw: Running, http: aiohttp.ClientSession,
                                                      until: Any) -> None:
    async with Events(http, gw) as ev:
        await _call(http, gw, "a1", tool=True, stream=True)
        await _call(http, gw, "a1", tool=True, stream=False)
        # A side request of the harness (no tools offered) answered in text ends nothing.
        await _call(http, gw, "a1", tool=False, stream=False, offer=False)
        ids = {d["id"] for d in (await state(http, gw, "?sessions=1"))["sessions"]["details"]}
        assert "a1" in ids  # a tool call: the agent comes back with its result
        await _call(http, gw, "a1", tool=False, stream=True)  # the answer
        await until(lambda: "session_end" in ev.types("a1"))
    end = [e for e in ev.of("a1") if e["type"] == "session_end"]
    assert [(e["reason"], e["turns"]) for e in end] == [("answered", 4)]  # published once
    assert ev.types("a1")[-2:] == ["llm_end", "session_end"]  # no tool phase after the answer
    doc = await state(http, gw, "?sessions=1")
    assert "a1" not in {d["id"] for d in doc["sessions"]["details"]}
    assert doc["tools"]["in_flight"] == 0
    assert await _ended(http, gw, "answered") == 1.0
    # The same key's next session is known to call tools: a non-streamed answer ends it too.
    await _call(http, gw, "a2", tool=True, stream=False)
    await _call(http, gw, "a2", tool=False, stream=False)
    await until(lambda: not any(k.endswith("/id/a2") for k in list(gw.gateway.sessions.keys())))


async def test_keys_whose_replies_never_call_tools_keep_their_sessions(
        gw: Running, http: aiohttp.ClientSession) -> None:
    other = {"Authorization": "Bearer sk-tenant-text"}
    await _call(http, gw, "t0", tool=True, stream=False)  # another key calls tools
    for _ in range(3):  # text-action agents answer in text on every turn
        await _call(http, gw, "t1", tool=False, stream=True, auth=other)
    doc = await state(http, gw, "?sessions=1")
    assert "t1" in {d["id"] for d in doc["sessions"]["details"]}
    assert await _ended(http, gw, "answered") == 0.0
