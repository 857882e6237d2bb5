"""Agent trees through the gateway (real HTTP, an emulated worker): a Claude Code sub-agent
(same X-Claude-Code-Session-Id, its own x-claude-code-agent-id) is a session of its own, child
of the main agent; admitted ahead of a new session that waited longer; shown in
/mars/v1/state as a tree."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.integration.admission.conftest import Stack, StackFactory

SID = "3f0c1d2e-cc-session"


async def _chat(s: Stack, headers: dict[str, str], final: bool = False) -> int:
    h = {"Authorization": "Bearer k", **headers}
    if final:
        h["x-session-final"] = "true"
    body = {"model": "tiny-emulated", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4}
    async with s.http.post(s.url("/v1/chat/completions"), json=body, headers=h) as r:
        await r.read()
        return r.status


def _sessions(state: dict[str, Any]) -> dict[str, Any]:
    return {d["id"]: d for d in state["sessions"].get("details", [])}


async def test_a_claude_code_sub_agent_goes_ahead_of_new_sessions(
    make_stack: StackFactory,
) -> None:
    s = await make_stack(window=2)
    main = {"X-Claude-Code-Session-Id": SID}
    sub = {"X-Claude-Code-Session-Id": SID, "x-claude-code-agent-id": "agent-1",
           "x-claude-code-parent-agent-id": "main-agent"}
    assert await _chat(s, {"x-session-id": "holder"}) == 200
    assert await _chat(s, main) == 200  # the main agent: both slots are taken now
    newcomer = asyncio.create_task(_chat(s, {"x-session-id": "new"}))
    await s.until(lambda: _queued(s, 1))
    child = asyncio.create_task(_chat(s, sub))
    await s.until(lambda: _queued(s, 2))
    assert await _chat(s, {"x-session-id": "holder"}, final=True) == 200  # one slot frees
    assert await asyncio.wait_for(child, 10) == 200
    assert not newcomer.done() and await s.queue_length() == 1
    async with s.http.get(s.url("/mars/v1/state?sessions=1")) as r:
        state = await r.json()
    assert state["sessions"]["trees"] == {SID: [f"{SID}/agent/agent-1"]}
    rows = _sessions(state)
    assert rows[f"{SID}/agent/agent-1"]["parent"] == SID and rows[SID]["parent"] is None
    assert await _chat(s, sub, final=True) == 200  # the child is done: its slot frees
    assert await asyncio.wait_for(newcomer, 10) == 200
    newcomer.cancel()


async def _queued(s: Stack, n: int) -> bool:
    return await s.queue_length() == n


async def test_an_explicit_parent_header_links_a_session(make_stack: StackFactory) -> None:
    s = await make_stack(window=4)
    assert await _chat(s, {"x-session-id": "p"}) == 200
    assert await _chat(s, {"x-session-id": "c", "x-parent-session-id": "p"}) == 200
    state = await s.state()
    assert state["sessions"]["trees"] == {"p": ["c"]}
