"""A session ends on its answer, through the gateway over real sockets: a reply that calls no
tool, to a request that offered tools, ends the session of a key whose replies call tools
(core/answers.py), unless its sessions come straight back after their answers; a key whose
replies never did keeps its sessions until they idle. Workers: the fake of conftest.py."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from marsproxy.core.identity import tenant_of
from marsproxy.gateway.http.app import Running
from marsproxy.policy.plane import Phase

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


def _phase(gw: Running, session: str, auth: dict[str, str] = AUTH) -> Phase:
    return gw.gateway.plane.phase(f"{tenant_of(auth['Authorization'])}/id/{session}")


async def test_the_answer_ends_a_tool_calling_session(gw: Running, http: aiohttp.ClientSession,
                                                      until: Any) -> None:
    async with Events(http, gw) as ev:
        await _call(http, gw, "a1", tool=True, stream=True)
        await _call(http, gw, "a1", tool=True, stream=False)
        # A side request of the harness (no tools offered) answered in text ends nothing.
        await _call(http, gw, "a1", tool=False, stream=False, offer=False)
        assert _phase(gw, "a1") is Phase.DORMANT  # a tool call: the agent comes back
        await _call(http, gw, "a1", tool=False, stream=True)  # the answer
        await until(lambda: "session_end" in ev.types("a1"))
        await asyncio.sleep(0.1)  # anything more would have arrived by now
    end = [e for e in ev.of("a1") if e["type"] == "session_end"]
    assert [(e["reason"], e["turns"]) for e in end] == [("answered", 4)]  # published once
    assert ev.types("a1")[-2:] == ["llm_end", "session_end"]  # no tool phase after the answer
    assert _phase(gw, "a1") is Phase.ENDED  # its slot and KV room are free
    assert (await state(http, gw))["tools"]["in_flight"] == 0
    # The table keeps it (as after an idle timeout): a client that goes on continues it.
    doc = await state(http, gw, "?sessions=1")
    assert "a1" in {d["id"] for d in doc["sessions"]["details"]}


async def test_sessions_that_go_on_after_their_answers_are_kept(
        gw: Running, http: aiohttp.ClientSession, until: Any) -> None:
    # A harness that answers a tool-less reply itself ("please continue") comes straight back:
    # once it did, its key's answers no longer end its sessions (core/answers.py).
    async with Events(http, gw, "&type=session_end,session_admitted") as ev:
        await _call(http, gw, "h1", tool=True, stream=False)
        await _call(http, gw, "h1", tool=False, stream=False)  # the answer: ended ...
        await until(lambda: "session_end" in ev.types("h1"))
        await _call(http, gw, "h1", tool=True, stream=False)  # ... and back at once
        await _call(http, gw, "h1", tool=False, stream=True)  # kept through this answer
        await asyncio.sleep(0.2)
    assert ev.types("h1") == ["session_admitted", "session_end", "session_admitted"]
    assert _phase(gw, "h1") is Phase.DORMANT


async def test_keys_whose_replies_never_call_tools_keep_their_sessions(
        gw: Running, http: aiohttp.ClientSession) -> None:
    other = {"Authorization": "Bearer sk-tenant-text"}
    await _call(http, gw, "t0", tool=True, stream=False)  # another key calls tools
    for _ in range(3):  # text-action agents answer in text on every turn
        await _call(http, gw, "t1", tool=False, stream=True, auth=other)
    assert _phase(gw, "t1", other) is Phase.DORMANT

