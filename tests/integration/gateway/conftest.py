"""A small scriptable fake worker, and helpers to run apps on loopback ports.

The fake answers like vLLM (SSE framing, usage chunk on include_usage) and records what it
received. Behaviour per request comes from the ``x-fake`` header:
``ok`` (default), ``hang`` (never answers), ``stall`` (one event, then silence),
``slow`` (20 events, 50 ms apart), ``404`` (an upstream error), ``negative`` (negative
token counts in the usage), ``odd`` and ``deep`` (JSON of a broken engine).

The fixtures below are shared by the test modules: ``fake``, ``dead_url``, ``until``,
``run_app``, an ``http`` client session and ``gw`` (a gateway in front of ``fake``).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from marsproxy.gateway.http.app import Running, start

from .telemetry_client import config as telemetry_config


@dataclass
class Seen:
    method: str
    path_qs: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeWorker:
    seen: list[Seen] = field(default_factory=list)
    active: int = 0
    cancelled: int = 0
    completed: int = 0
    healthy: bool = True
    runner: web.AppRunner | None = None
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        # The proxy's probe (vLLM's /metrics/ renders what name[] names); not recorded in seen.
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/metrics/", self._metrics)
        # The probe's other read (max_model_len); not recorded in seen either.
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_route("*", "/{tail:.*}", self._echo)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "fake", "object": "model", "owned_by": "vllm", "max_model_len": 4096}]})

    async def _metrics(self, _: web.Request) -> web.Response:
        page = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0"}} {self.active}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{engine="0"} 0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="0"}} {0.1 * self.active}\n'
        )
        return web.Response(text=page, content_type="text/plain")

    async def _echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append(Seen(request.method, request.path_qs, dict(request.headers), body))
        resp = web.json_response(
            {
                "path": request.path,
                "method": request.method,
                "query": request.query_string,
                "body": body.decode(),
            }
        )
        if request.path == "/set-cookie":  # a worker (or what sits before it) setting a cookie
            resp.set_cookie("worker_affinity", "secret-of-the-first-client")
        return resp

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(Seen(request.method, request.path_qs, dict(request.headers), body))
        mode = request.headers.get("x-fake", "ok")
        obj = json.loads(body)
        self.active += 1
        try:
            if mode == "hang":
                await asyncio.sleep(3600)
            if mode == "odd":  # 200, JSON, fields of the wrong shape (a broken engine or shim)
                return web.json_response({"usage": {"prompt_tokens": "x"},
                                          "content": [7], "choices": 5})
            if mode == "deep":  # 200, JSON nested deeper than the interpreter's stack
                deep = b"[" * 100_000 + b"]" * 100_000
                return web.Response(body=b'{"usage":{},"x":' + deep + b"}",
                                    content_type="application/json")
            if mode == "404":
                return web.json_response(
                    {
                        "error": {
                            "message": "The model `nope` does not exist.",
                            "type": "NotFoundError",
                            "code": 404,
                        }
                    },
                    status=404,
                )
            n = 20 if mode == "slow" else 3
            words = [f"w{i} " for i in range(n)]
            usage: dict[str, Any] = {"prompt_tokens": 7, "completion_tokens": n,
                                     "total_tokens": 7 + n}
            if mode == "negative":  # a broken engine or shim's counts
                usage["prompt_tokens_details"] = {"cached_tokens": -1}
                usage["completion_tokens"] = -n
            # "tool": the reply calls a tool, as vLLM answers a forced call (finish "stop").
            call = {"id": "chatcmpl-tool-1", "type": "function",
                    "function": {"name": "run", "arguments": "".join(words)}}
            if not obj.get("stream"):
                self.completed += 1
                message: dict[str, Any] = {"role": "assistant", "content": "".join(words)}
                if mode == "tool":
                    message = {"role": "assistant", "content": None, "tool_calls": [call]}
                return web.json_response(
                    {
                        "id": "c",
                        "object": "chat.completion",
                        "model": "fake",
                        "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
                        "usage": usage,
                    }
                )
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i, w in enumerate(words):
                delta: dict[str, Any] = {"content": w}
                if mode == "tool":
                    fn = {"arguments": w} if i else {"name": "run", "arguments": w}
                    delta = {"content": None, "tool_calls": [{"index": 0, "function": fn}]}
                chunk = {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "model": "fake",
                    "choices": [
                        {
                            "index": 0,
                            "delta": delta,
                            "finish_reason": "stop" if i == n - 1 else None,
                        }
                    ],
                }
                await resp.write(sse(chunk))
                if mode == "stall":
                    await asyncio.sleep(3600)
                if mode == "slow":
                    await asyncio.sleep(0.05)
            if (obj.get("stream_options") or {}).get("include_usage"):
                await resp.write(
                    sse(
                        {
                            "id": "c",
                            "object": "chat.completion.chunk",
                            "model": "fake",
                            "choices": [],
                            "usage": usage,
                        }
                    )
                )
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.completed += 1
            return resp
        except (asyncio.CancelledError, ConnectionError):
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic style: usage in message_start and message_delta."""
        body = await request.read()
        self.seen.append(Seen(request.method, request.path_qs, dict(request.headers), body))
        events = [
            (
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": "m",
                        "role": "assistant",
                        "content": [],
                        "usage": {"input_tokens": 11, "output_tokens": 1},
                    },
                },
            ),
            (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            ),
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "Done."},
                },
            ),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn"},
                    "usage": {"output_tokens": 5},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]
        return await self._sse_events(request, events)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(Seen(request.method, request.path_qs, dict(request.headers), body))
        output = [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Done."}],
            }
        ]
        events = [
            ("response.created", {"type": "response.created", "response": {"id": "r"}}),
            (
                "response.output_text.delta",
                {"type": "response.output_text.delta", "delta": "Done."},
            ),
            (
                "response.completed",
                {
                    "type": "response.completed",
                    "response": {
                        "id": "r",
                        "output": output,
                        "usage": {"input_tokens": 13, "output_tokens": 2},
                    },
                },
            ),
        ]
        return await self._sse_events(request, events)

    async def _sse_events(
        self, request: web.Request, events: list[tuple[str, dict[str, Any]]]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for name, obj in events:
            await resp.write(f"event: {name}\n".encode() + sse(obj))
        await resp.write_eof()
        self.completed += 1
        return resp

    async def start(self) -> FakeWorker:
        self.runner, self.url = await run_app(self.app())
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def run_app(app: web.Application, port: int = 0) -> tuple[web.AppRunner, str]:
    """Start ``app`` on 127.0.0.1 (a free port unless given); handlers cancel on disconnect."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner, f"http://127.0.0.1:{sock.getsockname()[1]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def until(cond: Any, within: float = 10.0) -> None:
    """Wait for ``cond()`` to hold (polling); fail the test if it never does."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition never held")
        await asyncio.sleep(0.02)


# -- fixtures (the test modules cannot import this file under --import-mode=importlib) --------


@pytest.fixture
async def fake() -> AsyncIterator[FakeWorker]:
    w = await FakeWorker().start()
    yield w
    await w.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session for the test's own requests."""
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def gw(fake: FakeWorker) -> AsyncIterator[Running]:
    """A gateway in front of ``fake`` with the information-stream tests' config."""
    g = await start(telemetry_config([fake.url]))
    yield g
    await g.stop()


@pytest.fixture
def dead_url() -> str:
    """A worker URL nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture(name="until")
def until_fixture() -> Any:
    return until


@pytest.fixture(name="run_app")
def run_app_fixture() -> Any:
    """``await run_app(app)`` → (runner, url); the runner cancels handlers on disconnect."""
    return run_app


@pytest.fixture
async def two() -> AsyncIterator[Any]:
    """Two workers keeping their own Responses replies (``responses_worker.StoringWorker``)."""
    from .responses_worker import StoringWorker  # it builds on FakeWorker, above

    workers = [await StoringWorker("a").start(), await StoringWorker("b").start()]
    yield workers
    for w in workers:
        await w.stop()
