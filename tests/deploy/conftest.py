"""Fixtures for the deployment tests: a real marsproxy gateway in-process in front of emulated
vLLM workers (``marsproxy emulate``'s app) or a small Anthropic-style fake, on loopback ports.

Test modules cannot import this file (``--import-mode=importlib``); they get what they need as
fixtures.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from marsproxy.bench.local import LocalServer, start_local
from marsproxy.config import load_config
from marsproxy.emulator.server import EmulatorOptions
from marsproxy.emulator.server import create_app as create_emulator
from marsproxy.gateway.http.app import Running, start

REPO = Path(__file__).resolve().parents[2]
MODEL = "coder"


@dataclass
class Stack:
    """A started gateway (``url``: http://127.0.0.1:PORT) and its workers."""

    url: str
    gateway: Running
    workers: list[LocalServer] = field(default_factory=list)
    seen_headers: list[dict[str, str]] = field(default_factory=list)

    async def get_json(self, path: str) -> Any:
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.get(self.url + path)
            r.raise_for_status()
            return r.json()

    async def metrics(self) -> str:
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.get(self.url + "/metrics")
            r.raise_for_status()
            return r.text

    async def sessions(self) -> dict[str, dict[str, Any]]:
        """Session id → details row of ``/mars/v1/state?sessions=1``."""
        doc = await self.get_json("/mars/v1/state?sessions=1&limit=1000")
        return {row["id"]: row for row in doc["sessions"].get("details", [])}

    async def stop(self) -> None:
        await self.gateway.stop()
        for w in self.workers:
            await w.stop()


def _anthropic_worker(seen: list[dict[str, str]]) -> web.Application:
    """An Anthropic Messages API worker that records what reached it (vLLM and the emulator serve
    /v1/messages; this one lets the test read the headers)."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(_: web.Request) -> web.Response:
        page = (
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0"} 0\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{engine="0"} 0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{engine="0"} 0.1\n'
        )
        return web.Response(text=page, content_type="text/plain")

    async def messages(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        body = await request.json()
        events: list[tuple[str, dict[str, Any]]] = [
            ("message_start", {"type": "message_start", "message": {
                "id": "msg_1", "type": "message", "role": "assistant", "model": body["model"],
                "content": [], "stop_reason": None,
                "usage": {"input_tokens": 11, "output_tokens": 1}}}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": "Done."}}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                               "usage": {"output_tokens": 5}}),
            ("message_stop", {"type": "message_stop"}),
        ]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for name, obj in events:
            await resp.write(f"event: {name}\ndata: {json.dumps(obj)}\n\n".encode())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/messages", messages)
    return app


StackFactory = Callable[..., Coroutine[Any, Any, Stack]]


@pytest.fixture
async def make_stack() -> AsyncIterator[StackFactory]:
    """``await make_stack(workers=2)`` (emulated vLLM; ``responses_store``: as with
    ``VLLM_ENABLE_RESPONSES_API_STORE=1``) or ``make_stack(anthropic=True)``."""
    stacks: list[Stack] = []

    async def make(workers: int = 1, anthropic: bool = False, responses_store: bool = False,
                   **overrides: Any) -> Stack:
        servers: list[LocalServer] = []
        seen: list[dict[str, str]] = []
        for _ in range(workers):
            if anthropic:
                app = _anthropic_worker(seen)
            else:
                app = create_emulator(EmulatorOptions(
                    profile="tiny", time_scale=0.01, served_model_name=MODEL,
                    responses_store=responses_store))
            servers.append(await start_local(app))
        cfg = load_config(
            None,
            environ={},
            overrides={
                "workers": [{"url": s.url, "name": f"w{i}"} for i, s in enumerate(servers)],
                "server": {"host": "127.0.0.1", "port": 0, "drain_timeout_s": 1.0},
                "probes": {"nvml": {"enabled": False}},
                **overrides,
            },
        )
        running = await start(cfg)
        stack = Stack(f"http://127.0.0.1:{running.port}", running, servers, seen)
        stacks.append(stack)
        return stack

    yield make
    for s in stacks:
        await s.stop()


@pytest.fixture
def repo() -> Path:
    return REPO
