"""The benchmark's agent against a real (emulated) worker: every turn sent in order, and each
tool phase reported around the tool itself, the end report before the next call."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from marsproxy.bench.agent import ReplayOptions, filler, replay_plan
from marsproxy.emulator.server import EmulatorOptions, create_app
from marsproxy.runs.workload import PlannedSession, PlannedTurn


@pytest.fixture
async def worker() -> AsyncIterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    runner = web.AppRunner(create_app(EmulatorOptions(profile="tiny", time_scale=0.01)))
    await runner.setup()
    await web.SockSite(runner, sock).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    await runner.cleanup()


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    """A chat endpoint that answers every call at once and records its headers."""
    seen: list[dict[str, str]] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({
            "id": "c", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    await runner.cleanup()


async def no_tool(seconds: float, kind: str) -> None:
    return None


async def test_tool_phases_are_reported_around_the_tool(worker: str) -> None:
    plan = PlannedSession("s1", "t", 0.0, (
        PlannedTurn(200, 4, 0.05, "pytest"),
        PlannedTurn(260, 4, 0.02, "grep"),
        PlannedTurn(300, 4, None, ""),
    ))
    log: list[tuple[str, str, float]] = []
    ran = asyncio.Event()

    async def on_tool(session: str, kind: str, tool: str) -> None:
        assert session == "s1"
        if kind == "tool_start":
            # Answered only once the tool has run: an agent that awaited this report before
            # starting its tool would never get there (the wait times out, the test fails).
            await asyncio.wait_for(ran.wait(), 5)
            ran.clear()
        log.append((kind, tool, time.perf_counter()))

    async def tool(seconds: float, kind: str) -> None:
        log.append(("run", kind, time.perf_counter()))
        ran.set()

    opts = ReplayOptions(base_url=worker, model="tiny-emulated", system_prompt_tokens=50)
    async with aiohttp.ClientSession() as http:
        res = await replay_plan(http, plan, opts, filler(50, random.Random(0)),
                                tool, on_tool)
    assert [t.ok for t in res.turns] == [True, True, True]
    assert [(k, t) for k, t, _ in log if k != "run"] == [
        ("tool_start", "pytest"), ("tool_end", "pytest"),
        ("tool_start", "grep"), ("tool_end", "grep")]
    ends = [ts for k, _, ts in log if k == "tool_end"]
    # each end report precedes the next call
    assert all(end < turn.sent_at for end, turn in zip(ends, res.turns[1:], strict=True))


async def test_a_mixed_workloads_session_sends_its_class_and_its_tenants_key(
    recorder: tuple[str, list[dict[str, str]]],
) -> None:
    # bench live --classes / --tenants (runs/mix.py): each session names its group to the proxy.
    url, seen = recorder
    opts = ReplayOptions(base_url=url, model="m", system_prompt_tokens=10)
    turns = (PlannedTurn(50, 1, None, ""),)
    plans = [PlannedSession("batch/s1", "t", 0.0, turns, mix="batch", cls="batch"),
             PlannedSession("light/s2", "t", 0.0, turns, mix="light", tenant="light"),
             PlannedSession("s3", "t", 0.0, turns)]
    async with aiohttp.ClientSession() as http:
        for plan in plans:
            res = await replay_plan(http, plan, opts, filler(10, random.Random(0)), no_tool)
            assert [t.ok for t in res.turns] == [True]
    assert seen[0]["x-session-class"] == "batch" and "Authorization" not in seen[0]
    assert seen[1]["Authorization"] == "Bearer sk-bench-light"
    assert "x-session-class" not in seen[1]
    assert "x-session-class" not in seen[2] and "Authorization" not in seen[2]


@pytest.mark.parametrize("plain", [False, True])
async def test_a_plain_client_sends_no_session_id_and_no_final_flag(
    recorder: tuple[str, list[dict[str, str]]], plain: bool,
) -> None:
    # bench live --plain-clients: the agent sends what a plain OpenAI client sends.
    url, seen = recorder
    opts = ReplayOptions(base_url=url, model="m", system_prompt_tokens=10, plain=plain)
    plan = PlannedSession("s1", "t", 0.0, (PlannedTurn(50, 1, 0.0, "bash"),
                                           PlannedTurn(60, 1, None, "")))
    async with aiohttp.ClientSession() as http:
        res = await replay_plan(http, plan, opts, filler(10, random.Random(0)), no_tool)
    assert [t.ok for t in res.turns] == [True, True]
    ids = [h.get("x-session-id") for h in seen]
    finals = [h.get("x-session-final") for h in seen]
    if plain:
        assert ids == [None, None] and finals == [None, None]
    else:
        assert ids == ["s1", "s1"] and finals == [None, "true"]
