"""aiohttp server with vLLM's OpenAI-compatible HTTP surface over the emulated engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from marsproxy.emulator import openai_api as api
from marsproxy.emulator import tool_calls as tools
from marsproxy.emulator.http_util import SSE_HEADERS as _SSE_HEADERS
from marsproxy.emulator.http_util import error_response as _error
from marsproxy.emulator.http_util import json_response as _json
from marsproxy.emulator.http_util import pump
from marsproxy.emulator.http_util import read_json as _read_json
from marsproxy.emulator.http_util import sse as _sse
from marsproxy.emulator.http_util import wait_update as _wait_update
from marsproxy.emulator.kv_events import KVEventsConfig
from marsproxy.emulator.messages_http import MessagesHandlers
from marsproxy.emulator.profiles import get_profile
from marsproxy.emulator.request import FinishedEvent, RequestError
from marsproxy.emulator.runner import EngineRunner, TokenStream
from marsproxy.emulator.tokenizer import filler_chunk, filler_text

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

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, kind: api.Kind) -> web.StreamResponse:
        try:
            parsed = api.parse_request(
                kind, await _read_json(request), self.model,
                self.runner.profile.effective_max_model_len)
        except api.ApiError as exc:
            return _error(exc)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:16]
        try:
            stream = self.runner.submit(
                rid, parsed.prompt_token_ids, parsed.max_tokens, parsed.ignore_eos,
                parsed.priority, parsed.session_id,
            )
        except RequestError as exc:
            return _error(api.bad_request(str(exc)))
        try:
            if parsed.stream:
                return await self._stream(request, parsed, rid, stream)
            try:
                while stream.finished is None:
                    await _wait_update(stream, request)
            except ConnectionResetError:
                return web.Response(status=499)  # nobody reads it; the request is aborted below
            fin = stream.finished
            text = (parsed.echo or "") + filler_text(0, fin.completion_tokens)
            u = self._usage(kind, fin)
            tool = parsed.tool
            if tool is None:
                body = api.full_response(
                    kind, rid, int(time.time()), self.model, text, fin.finish_reason, u)
            else:  # a forced tool choice: the generated text becomes the call's arguments
                body = api.full_response(
                    kind, rid, int(time.time()), self.model, "",
                    tool.finish_reason(fin.finish_reason), u,
                    tool_calls=[tools.tool_call(tool, tools.tool_call_id(), text)],
                )
            return _json(body)
        finally:
            self.runner.release(rid)

    async def _stream(
        self, request: web.Request, parsed: api.ParsedRequest, rid: str, stream: TokenStream
    ) -> web.StreamResponse:
        created = int(time.time())
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        # A client that went away mid-stream ends the handler quietly; release() aborts.
        with contextlib.suppress(ConnectionResetError):
            await self._pump(resp, request, parsed, rid, created, stream)
        return resp

    async def _pump(
        self, resp: web.StreamResponse, request: web.Request, parsed: api.ParsedRequest,
        rid: str, created: int, stream: TokenStream,
    ) -> None:
        """Write the stream's tokens as SSE events until it finishes."""
        kind, tool, model = parsed.kind, parsed.tool, self.model
        continuous, n_prompt = parsed.continuous_usage, len(parsed.prompt_token_ids)
        # Every token chunk is the same JSON except its text: build the frame once.
        if tool is None:
            template = api.chunk(kind, rid, created, model, "\x00")
        else:  # a forced tool choice: each token appends its text to the call's arguments
            template = tools.tool_chunk(rid, created, model, tool, "\x00")
        call_id = tools.tool_call_id() if tool is not None else ""
        head, tail = ("data: " + json.dumps(template, separators=(",", ":"))).split('"\\u0000"')
        head_b, tail_b = head.encode(), (tail + "\n\n").encode()

        def frame(obj: dict[str, Any], done: int) -> bytes:
            """An event; with continuous_usage_stats it carries the usage so far."""
            if continuous:
                obj = api.with_usage(obj, api.running_usage(kind, n_prompt, done))
            return _sse(obj)

        def token_chunk(i: int, reason: str | None) -> dict[str, Any]:
            """Token ``i``'s chunk; ``reason`` on the last one (with the fingerprint when no
            usage chunk follows); a completions echo prefixes the first with the prompt."""
            last, piece = reason is not None, filler_chunk(i)
            if tool is not None:
                obj = tools.tool_chunk(rid, created, model, tool, tool.piece(piece, i == 0, last),
                                       finish_reason=reason)
                if last and not parsed.include_usage:
                    obj["system_fingerprint"] = api.SYSTEM_FINGERPRINT
                return obj
            echo_ids = parsed.echo_ids if i == 0 else None
            if echo_ids is not None:
                piece = (parsed.echo or "") + piece
            return api.chunk(kind, rid, created, model, piece, reason,
                             fingerprint=last and not parsed.include_usage,
                             prompt_token_ids=echo_ids)

        def frames(sent: int, avail: int, fin: FinishedEvent | None) -> tuple[list[bytes], int]:
            parts: list[bytes] = []
            if sent == 0 and avail > 0 and kind == "chat":
                parts.append(frame(api.chunk(kind, rid, created, model, "", role=True), 0))
            if sent == 0 and avail > 0 and tool is not None:  # the call is named first
                parts.append(frame(tools.tool_chunk(rid, created, model, tool, "", call_id), 1))
            last = avail - 1 if fin is not None else avail
            for i in range(sent, last):
                if continuous or (i == 0 and parsed.echo_ids is not None):
                    parts.append(frame(token_chunk(i, None), i + 1))
                elif tool is None:
                    parts.append(head_b + json.dumps(filler_chunk(i)).encode() + tail_b)
                else:
                    parts.append(head_b + json.dumps(
                        tool.piece(filler_chunk(i), i == 0, False)).encode() + tail_b)
            if fin is not None:
                reason = fin.finish_reason if tool is None else tool.finish_reason(
                    fin.finish_reason)
                parts.append(frame(token_chunk(avail - 1, reason), avail))
                if parsed.include_usage:
                    u = self._usage(kind, fin, streamed=True)
                    parts.append(_sse(api.usage_chunk(kind, rid, created, model, u)))
                parts.append(b"data: [DONE]\n\n")
            return parts, last

        await pump(resp, request, stream, frames)

    def _usage(self, kind: api.Kind, fin: FinishedEvent, streamed: bool = False) -> dict[str, Any]:
        created = api.created_cache_tokens(
            fin.prompt_tokens, fin.cached_tokens, self.runner.profile.block_size)
        return api.usage(kind, fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens,
                         created, streamed)

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
            ids = api.tokenize_body(body)
        except api.ApiError as exc:
            return _error(exc)
        return _json({
            "count": len(ids), "max_model_len": self.runner.profile.effective_max_model_len,
            "tokens": ids, "token_strs": None,
        })

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

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
    msgs = MessagesHandlers(runner)
    app.router.add_post("/v1/chat/completions", h.chat)
    app.router.add_post("/v1/completions", h.completions)
    app.router.add_post("/v1/messages", msgs.messages)
    app.router.add_post("/v1/messages/count_tokens", msgs.count_tokens)
    app.router.add_get("/v1/models", h.models)
    app.router.add_post("/tokenize", h.tokenize)
    app.router.add_get("/health", h.health)
    app.router.add_get("/ping", h.health)
    app.router.add_post("/ping", h.health)
    app.router.add_get("/version", h.version)
    app.router.add_get("/metrics", h.metrics)
    app.router.add_get("/metrics/", h.metrics)
    app.router.add_get("/kv_event_sources", h.kv_event_sources)
    app.router.add_route("*", "/{tail:.*}", _no_route)  # last: only what nothing else serves

    async def _start(app: web.Application) -> None:
        app[RUNNER_KEY].start()

    async def _stop(app: web.Application) -> None:
        await app[RUNNER_KEY].stop()

    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)
    return app


async def serve(opts: EmulatorOptions) -> None:
    """Listen on ``opts.host:opts.port`` until SIGTERM/SIGINT, then shut down cleanly."""
    app = create_app(opts)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the
    # request in the engine (as vLLM aborts on disconnect).
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, opts.host, opts.port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
