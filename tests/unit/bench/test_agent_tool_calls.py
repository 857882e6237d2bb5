"""The benchmark agent acting through tool calls (``ReplayOptions.tool_calls``) against the
emulated worker, seen through a recording relay: every turn but the last forces a call and gets
one; the call and its observation go back into the history as the assistant's ``tool_calls``
and a ``tool`` message sized as the ``user`` message it replaces; the last turn answers in
text. Without the option the requests are what they always were."""

from __future__ import annotations

import json
import random
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from marsproxy.bench.agent import RUN_TOOL, ReplayOptions, filler, replay_plan
from marsproxy.emulator.server import EmulatorOptions, create_app
from marsproxy.emulator.tokenizer import filler_text
from marsproxy.runs.workload import PlannedSession, PlannedTurn

Exchange = tuple[dict[str, Any], list[dict[str, Any]]]  # request body, reply chunks
PLAN = PlannedSession("s1", "t", 0.0, (
    PlannedTurn(200, 5, 0.0, "pytest"),
    PlannedTurn(260, 6, 0.0, "grep"),
    PlannedTurn(330, 7, None, ""),
))


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    return runner, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
async def relay() -> AsyncIterator[tuple[str, list[Exchange]]]:
    """The emulator behind a relay that records each request body and the chunks answered."""
    worker, worker_url = await _serve(create_app(EmulatorOptions(profile="tiny",
                                                                 time_scale=0.01)))
    seen: list[Exchange] = []
    async with aiohttp.ClientSession() as upstream:

        async def chat(request: web.Request) -> web.Response:
            body = await request.json()
            async with upstream.post(f"{worker_url}/v1/chat/completions", json=body) as resp:
                raw = await resp.read()
                ctype = resp.headers["Content-Type"]
            frames = raw.decode().split("\n\n")[:-1]
            chunks = [json.loads(f[6:]) for f in frames if f != "data: [DONE]"]
            seen.append((body, chunks))
            return web.Response(body=raw, status=resp.status, headers={"Content-Type": ctype})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner, url = await _serve(app)
        yield url, seen
        await runner.cleanup()
    await worker.cleanup()


async def no_tool(seconds: float, kind: str) -> None:
    return None


async def _replay(url: str, tool_calls: bool) -> None:
    opts = ReplayOptions(base_url=url, model="tiny-emulated", system_prompt_tokens=50,
                         plain=True, tool_calls=tool_calls)
    async with aiohttp.ClientSession() as http:
        res = await replay_plan(http, PLAN, opts, filler(50, random.Random(0)), no_tool)
    assert [t.ok for t in res.turns] == [True, True, True]
    assert all(t.ttft_s is not None for t in res.turns)


def _calls(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for ch in chunks for choice in ch["choices"]
            for c in choice["delta"].get("tool_calls") or ()]


def _text(chunks: list[dict[str, Any]]) -> str:
    return "".join(choice["delta"].get("content") or ""
                   for ch in chunks for choice in ch["choices"])


async def test_every_turn_but_the_last_is_a_tool_call(
    relay: tuple[str, list[Exchange]],
) -> None:
    url, seen = relay
    await _replay(url, tool_calls=True)
    assert len(seen) == 3
    bodies = [body for body, _ in seen]
    assert all(b["tools"] == [RUN_TOOL] for b in bodies)
    assert [b["tool_choice"] for b in bodies] == ["required", "required", "none"]
    calls = []
    for (_, chunks), turn in zip(seen[:2], PLAN.turns[:2], strict=True):
        deltas = _calls(chunks)
        assert deltas and deltas[0]["function"]["name"] == "run"
        args = json.loads("".join(d["function"].get("arguments", "") for d in deltas))
        assert args == {"command": filler_text(0, turn.output_tokens)}
        assert _text(chunks) == ""
        calls.append({"id": deltas[0]["id"], "type": "function",
                      "function": {"name": "run", "arguments": json.dumps(args)}})
    last = seen[2][1]
    assert not _calls(last) and _text(last) == filler_text(0, PLAN.turns[2].output_tokens)
    # The second request carries the first call back, then its observation as a tool message.
    history = bodies[1]["messages"]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "tool"]
    assert history[2] == {"role": "assistant", "content": None, "tool_calls": [calls[0]]}
    assert history[3]["tool_call_id"] == calls[0]["id"]
    roles = [m["role"] for m in bodies[2]["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert bodies[2]["messages"][4]["tool_calls"] == [calls[1]]
    # Each request is the previous one's messages plus the reply and the observation.
    assert bodies[2]["messages"][:4] == history


async def test_observations_are_sized_as_the_user_messages_they_replace(
    relay: tuple[str, list[Exchange]],
) -> None:
    url, seen = relay
    await _replay(url, tool_calls=False)
    await _replay(url, tool_calls=True)
    plain, tools = [b for b, _ in seen[:3]], [b for b, _ in seen[3:]]
    for p, t in zip(plain[1:], tools[1:], strict=True):
        observations = [m for m in t["messages"] if m["role"] == "tool"]
        users = [m for m in p["messages"] if m["role"] == "user"][1:]
        assert [m["content"] for m in observations] == [m["content"] for m in users]
    # the same token plan: equal prompts but for the calls' wrapping
    assert plain[0]["messages"] == tools[0]["messages"]


async def test_without_the_option_requests_carry_no_tools(
    relay: tuple[str, list[Exchange]],
) -> None:
    url, seen = relay
    await _replay(url, tool_calls=False)
    for body, chunks in seen:
        assert list(body) == ["model", "messages", "max_tokens", "ignore_eos", "stream",
                              "stream_options"]
        assert not _calls(chunks)
        assert all(m["role"] in ("system", "user", "assistant") and "tool_calls" not in m
                   for m in body["messages"])


@pytest.mark.parametrize("tool_calls", [False, True])
async def test_prompts_following_the_usage_keep_to_the_plan(
    relay: tuple[str, list[Exchange]], tool_calls: bool,
) -> None:
    # The template wraps each reply and observation in tokens of its own (more for a tool
    # call): learnt from one continuation, the next ones are sized to the plan exactly.
    url, _ = relay
    plan = PlannedSession("s2", "t", 0.0, tuple(
        PlannedTurn(200 + 150 * i, 30, 0.0, "pytest") for i in range(4)))
    opts = ReplayOptions(base_url=url, model="tiny-emulated", system_prompt_tokens=50,
                         plain=True, tool_calls=tool_calls, follow_usage=True)
    async with aiohttp.ClientSession() as http:
        res = await replay_plan(http, plan, opts, filler(50, random.Random(0)), no_tool)
    over = [t.prompt_tokens - p.input_tokens for t, p in zip(res.turns, plan.turns, strict=True)]
    assert over[1] > 0 and over[2:] == [0, 0], over
