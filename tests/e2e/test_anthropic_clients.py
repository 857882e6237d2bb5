"""Claude-Code-style clients end to end: the ``anthropic`` SDK through ``marsproxy serve`` against
``marsproxy emulate`` (real processes), on ``/v1/messages``.

Between the proxy and the emulated worker sits a recording hop (real HTTP, forwards every
request unchanged) so the test can see what reached the worker: Claude Code's sub-agent
headers must arrive untouched, and the proxy must not add chat-only fields to a Messages body.
The proxy's own view of each call (session, usage) is read from its live event stream.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anthropic
import pytest
from aiohttp import web
from anthropic.types import MessageParam

from marsproxy.bench.procs import CLI, free_port, stop_all, wait_up

MODEL = "tiny-emulated"
SYSTEM = "You are a careful coding agent working in a large repository. " * 12
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


@dataclass
class Seen:
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class Recorder:
    """A forwarding hop in its own thread: every request goes on to ``upstream`` unchanged;
    ``/v1/messages`` requests are recorded."""

    upstream: str
    port: int = field(default_factory=free_port)
    seen: list[Seen] = field(default_factory=list)

    def start(self) -> None:
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        async def forward(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            if request.path == "/v1/messages":
                self.seen.append(Seen(dict(request.headers), json.loads(raw)))
            headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
            async with aiohttp.ClientSession() as http, http.request(
                request.method, self.upstream + request.path_qs, data=raw, headers=headers
            ) as up:
                resp = web.StreamResponse(status=up.status, headers={
                    k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp

        async def main() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", forward)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            ready.set()
            await asyncio.Event().wait()

        asyncio.run(main())


class Events:
    """The proxy's ``llm_end`` events, read from ``/mars/v1/events`` in a thread."""

    def __init__(self, url: str) -> None:
        self.items: list[dict[str, Any]] = []
        self._resp = urllib.request.urlopen(
            f"{url}/mars/v1/events?format=ndjson&type=llm_end", timeout=60)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._resp:
            if line.strip():
                self.items.append(json.loads(line))

    def wait(self, n: int) -> list[dict[str, Any]]:
        deadline = time.monotonic() + 20
        while len(self.items) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.items) >= n, self.items
        return self.items


@dataclass
class Stack:
    url: str
    recorder: Recorder
    events: Events


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        wport, pport = free_port(), free_port()
        worker = subprocess.Popen(
            [*CLI, "emulate", "--profile", "tiny", "--num-blocks", "512", "--port", str(wport)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(worker)
        wait_up(f"http://127.0.0.1:{wport}/health", worker)
        rec = Recorder(f"http://127.0.0.1:{wport}")
        rec.start()
        proxy = subprocess.Popen(  # no config file: the embedded defaults
            [*CLI, "serve", "--worker", f"http://127.0.0.1:{rec.port}", "--port", str(pport)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proxy)
        url = f"http://127.0.0.1:{pport}"
        wait_up(f"{url}/readyz", proxy)
        yield Stack(url, rec, Events(url))
    finally:
        stop_all(procs)


def _client(stack: Stack, **headers: str) -> anthropic.Anthropic:
    # ANTHROPIC_BASE_URL is the proxy without /v1, as Claude Code is configured.
    return anthropic.Anthropic(base_url=stack.url, api_key="EMPTY", default_headers=headers,
                               max_retries=0)


def _ends(stack: Stack, session: str, n: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        mine = [e for e in stack.events.items if e["session"].endswith(f"/id/{session}")]
        if len(mine) >= n:
            return mine
        time.sleep(0.05)
    raise AssertionError(f"{n} llm_end events for {session}: {stack.events.items}")


def test_a_claude_code_session_non_streaming(stack: Stack) -> None:
    sid = str(uuid.uuid4())
    cc = _client(stack, **{"x-claude-code-session-id": sid})
    first: list[MessageParam] = [
        {"role": "user", "content": "Fix the failing test in tests/test_io.py."}]
    m1 = cc.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=first)
    assert m1.type == "message" and m1.role == "assistant" and m1.stop_reason == "max_tokens"
    assert m1.content[0].type == "text" and m1.usage.output_tokens == 8
    # The next turn appends the reply and a tool result: the whole earlier prompt is cached.
    second: list[MessageParam] = [*first, {"role": "assistant", "content": [
        {"type": "text", "text": m1.content[0].text},
        {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"cmd": "pytest -x"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1 failed"}]}]
    m2 = cc.messages.create(model=MODEL, max_tokens=4, system=SYSTEM, messages=second)
    u1, u2 = m1.usage, m2.usage
    assert u2.cache_read_input_tokens and u2.cache_read_input_tokens > 0
    prompt1 = u1.input_tokens + (u1.cache_read_input_tokens or 0) + (
        u1.cache_creation_input_tokens or 0)
    prompt2 = u2.input_tokens + u2.cache_read_input_tokens + (u2.cache_creation_input_tokens or 0)
    assert prompt2 > prompt1
    # The proxy saw one session and counted the prompt with its cached part, as vLLM reported.
    e1, e2 = _ends(stack, sid, 2)
    assert (e1["prompt_tokens"], e1["completion_tokens"]) == (prompt1, 8)
    assert (e2["prompt_tokens"], e2["cached_tokens"]) == (prompt2, u2.cache_read_input_tokens)
    assert e1["session"] == e2["session"]


def test_streaming_with_a_sub_agent_header(stack: Stack) -> None:
    sid, agent = str(uuid.uuid4()), "a" + uuid.uuid4().hex[:16]
    sub = _client(stack, **{"x-claude-code-session-id": sid, "x-claude-code-agent-id": agent,
                            "x-claude-code-parent-agent-id": "main",
                            "anthropic-beta": "claude-code-20250219"})
    msgs: list[MessageParam] = [
        {"role": "user", "content": "Explore the repository layout, then report."}]
    kinds: list[str] = []
    with sub.messages.stream(model=MODEL, max_tokens=6, system=SYSTEM, messages=msgs) as s:
        kinds = [e.type for e in s if e.type != "text"]
        final = s.get_final_message()
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * 6,
                     "content_block_stop", "message_delta", "message_stop"]
    assert final.usage.output_tokens == 6 and final.stop_reason == "max_tokens"
    assert final.usage.input_tokens > 0  # a partial last block: the split is not all cached
    # A sub-agent is a session of its own, linked to the main agent's (docs/clients.md).
    (end,) = _ends(stack, f"{sid}/agent/{agent}", 1)
    prompt = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) + (
        final.usage.cache_creation_input_tokens or 0)
    assert (end["prompt_tokens"], end["completion_tokens"]) == (prompt, 6)
    assert end["cached_tokens"] == (final.usage.cache_read_input_tokens or 0)
    # What reached the worker: the sub-agent headers untouched, the body without chat-only keys.
    seen = next(s for s in stack.recorder.seen if s.headers.get("x-claude-code-agent-id"))
    assert seen.headers["x-claude-code-agent-id"] == agent
    assert seen.headers["x-claude-code-parent-agent-id"] == "main"
    assert seen.headers["x-claude-code-session-id"] == sid
    assert seen.headers["anthropic-beta"] == "claude-code-20250219"
    assert "stream_options" not in seen.body and "priority" not in seen.body
    assert seen.body["stream"] is True


def test_a_generic_client_names_its_session_with_x_session_id(stack: Stack) -> None:
    sid = "run-" + uuid.uuid4().hex[:8]
    c = _client(stack, **{"x-session-id": sid})
    msgs: list[MessageParam] = [{"role": "user", "content": "Summarize the diff."}]
    c.messages.create(model=MODEL, max_tokens=2, system=SYSTEM, messages=msgs)
    with c.messages.stream(model=MODEL, max_tokens=2, system=SYSTEM, messages=msgs) as s:
        s.until_done()
    e1, e2 = _ends(stack, sid, 2)
    assert e1["session"] == e2["session"]
    assert e2["cached_tokens"] > 0  # the same prompt again: found in the prefix cache


def test_count_tokens_passes_through(stack: Stack) -> None:
    c = _client(stack)
    msgs: list[MessageParam] = [{"role": "user", "content": "How long is this prompt?"}]
    n = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=msgs)
    m = c.messages.create(model=MODEL, max_tokens=1, system=SYSTEM, messages=msgs)
    u = m.usage
    assert n.input_tokens == u.input_tokens + (u.cache_read_input_tokens or 0) + (
        u.cache_creation_input_tokens or 0)


def test_bad_requests_get_vllms_errors(stack: Stack) -> None:
    c = _client(stack)
    msgs: list[MessageParam] = [{"role": "user", "content": "hi"}]
    # Validation failures: vLLM's OpenAI-shaped 400.
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.create(model=MODEL, max_tokens=0, messages=msgs)
    body = bad.value.body
    assert isinstance(body, dict)
    assert body["error"]["type"] == "Bad Request" and body["error"]["param"] == "body.max_tokens"
    # Errors while serving: Anthropic's shape.
    with pytest.raises(anthropic.NotFoundError) as missing:
        c.messages.create(model="no-such-model", max_tokens=2, messages=msgs)
    assert missing.value.body == {"type": "error", "error": {
        "type": "NotFoundError",
        "message": f"The model `no-such-model` does not exist. Valid aliases: {MODEL}."}}
    # A body that is not JSON never reaches the worker: the proxy's own OpenAI-shaped 400.
    req = urllib.request.Request(f"{stack.url}/v1/messages", data=b"{not json", headers={
        "content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(req, timeout=10)
    assert raw.value.code == 400
    assert json.loads(raw.value.read())["error"]["code"] == "invalid_json"
