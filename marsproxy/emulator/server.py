"""aiohttp server with vLLM's OpenAI-compatible HTTP surface over the emulated engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from marsproxy.emulator import openai_api as api
from marsproxy.emulator import openai_request as req
from marsproxy.emulator.http_util import error_response as _error
from marsproxy.emulator.http_util import json_response as _json
from marsproxy.emulator.http_util import read_json as _read_json
from marsproxy.emulator.kv_events import KVEventsConfig, StartError
from marsproxy.emulator.messages_http import MessagesHandlers
from marsproxy.emulator.openai_http import OpenAIHandlers
from marsproxy.emulator.profiles import get_profile
from marsproxy.emulator.responses_api import ResponseStore
from marsproxy.emulator.responses_http import ResponsesHandlers
from marsproxy.emulator.runner import EngineRunner

VLLM_VERSION = "0.32.0"


@dataclass(frozen=True)
class EmulatorOptions:
    profile: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 8000
    time_scale: float = 1.0
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    num_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    served_model_name: str | None = None
    kv_events: KVEventsConfig | None = None  # vLLM's --kv-events-config
    responses_store: bool = False  # vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1


RUNNER_KEY = web.AppKey("emulator_runner", EngineRunner)


async def _no_route(request: web.Request) -> web.Response:
    """No route, or a route with another method: the JSON vLLM's server (FastAPI over
    Starlette) answers, ``{"detail":"Not Found"}`` or ``{"detail":"Method Not Allowed"}`` with
    an ``allow`` header, where aiohttp's own answer is plain text. A catch-all route rather than
    a middleware, so that served routes pay nothing for it."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource.canonical != "/{tail}":
            allowed |= (await resource.resolve(request))[1]
    if not allowed:
        return _json({"detail": "Not Found"}, 404)
    resp = _json({"detail": "Method Not Allowed"}, 405)
    resp.headers["Allow"] = ", ".join(sorted(allowed))
    return resp


class _Handlers:
    def __init__(self, runner: EngineRunner) -> None:
        self.runner = runner
        self.model = runner.profile.model_name

    async def models(self, request: web.Request) -> web.Response:
        m = self.model
        return _json({"object": "list", "data": [{
            "id": m, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": m, "parent": None, "max_model_len": self.runner.profile.effective_max_model_len,
            "permission": [{
                "id": "modelperm-" + uuid.uuid4().hex[:16], "object": "model_permission",
                "created": int(time.time()), "allow_create_engine": False,
                "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
                "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                "group": None, "is_blocking": False,
            }],
        }]})

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request)
            if isinstance(body, dict) and body.get("model", self.model) not in (None, self.model):
                raise api.model_not_found(str(body["model"]), self.model)
            ids = req.tokenize_body(body)
        except api.ApiError as exc:
            return _error(exc)
        return _json({
            "count": len(ids), "max_model_len": self.runner.profile.effective_max_model_len,
            "tokens": ids, "token_strs": None,
        })

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def load(self, request: web.Request) -> web.Response:
        """The generation requests being served, as vLLM's ``/load`` with
        ``--enable-server-load-tracking`` (chat, completions, Messages and Responses)."""
        return _json({"server_load": self.runner.server_load})

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": VLLM_VERSION})

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        """The publisher's config by data-parallel rank, as vLLM 0.32 (empty without one)."""
        cfg = self.runner.kv_events
        return _json({} if cfg is None or not cfg.publishes else {"0": cfg.source()})

    async def metrics(self, request: web.Request) -> web.Response:
        """The whole page at /metrics; at /metrics/ (prometheus_client's app in vLLM) only the
        series named in ``name[]`` when given."""
        self.runner.metrics.record_state(self.runner.engine.stats())
        names = request.query.getall("name[]", []) if request.path.endswith("/") else []
        return web.Response(
            body=self.runner.metrics.render(names), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )


def create_app(opts: EmulatorOptions) -> web.Application:
    """The emulator app; its engine loop starts on app startup and stops on cleanup."""
    profile = get_profile(
        opts.profile, num_blocks=opts.num_blocks, max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens, max_model_len=opts.max_model_len,
        served_model_name=opts.served_model_name,
    )
    runner = EngineRunner(profile, opts.scheduling_policy, opts.time_scale, opts.kv_events)
    app = web.Application()
    app[RUNNER_KEY] = runner
    h = _Handlers(runner)
    gen = OpenAIHandlers(runner)
    msgs = MessagesHandlers(runner)
    resps = ResponsesHandlers(runner, ResponseStore(enabled=opts.responses_store))
    app.router.add_post("/v1/chat/completions", gen.chat)
    app.router.add_post("/v1/completions", gen.completions)
    app.router.add_post("/v1/messages", msgs.messages)
    app.router.add_post("/v1/messages/count_tokens", msgs.count_tokens)
    app.router.add_post("/v1/responses", resps.responses)
    app.router.add_get("/v1/responses/{response_id}", resps.retrieve)
    app.router.add_post("/v1/responses/{response_id}/cancel", resps.cancel)
    app.router.add_get("/v1/models", h.models)
    app.router.add_post("/tokenize", h.tokenize)
    app.router.add_get("/health", h.health)
    app.router.add_get("/ping", h.health)
    app.router.add_post("/ping", h.health)
    app.router.add_get("/load", h.load)
    app.router.add_get("/version", h.version)
    app.router.add_get("/metrics", h.metrics)
    app.router.add_get("/metrics/", h.metrics)
    app.router.add_get("/kv_event_sources", h.kv_event_sources)
    app.router.add_route("*", "/{tail:.*}", _no_route)  # last: only what nothing else serves

    async def _start(app: web.Application) -> None:
        app[RUNNER_KEY].start()

    async def _stop(app: web.Application) -> None:
        await resps.close()
        await app[RUNNER_KEY].stop()

    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)
    return app


async def serve(opts: EmulatorOptions) -> None:
    """Listen on ``opts.host:opts.port`` until SIGTERM/SIGINT, then shut down cleanly; a
    :class:`StartError` when the port or a KV event endpoint cannot be had."""
    app = create_app(opts)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the
    # request in the engine (as vLLM aborts on disconnect).
    runner = web.AppRunner(app, handler_cancellation=True)
    try:
        await runner.setup()  # binds the KV event sockets, if any
        site = web.TCPSite(runner, opts.host, opts.port)
        try:
            await site.start()
        except OSError as exc:  # a port taken, a host that is not this machine's
            reason = (os.strerror(exc.errno) if exc.errno and exc.errno > 0
                      else exc.strerror or str(exc))
            raise StartError(f"cannot listen on {opts.host}:{opts.port} (--host, --port):"
                             f" {reason}") from None
    except StartError:
        await runner.cleanup()
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
