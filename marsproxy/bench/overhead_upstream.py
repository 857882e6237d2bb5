"""The fast upstream of the overhead benchmark: an OpenAI-shaped responder with canned answers.

Not the emulator: the emulator runs an engine loop, a tokenizer and batches its SSE writes every
5 ms, all of which would land on the load generator's core and blur what the proxies add. This
answers ``POST /v1/chat/completions`` with a fixed reply at once:

- non-streaming: one ``chat.completion`` object with ``usage``;
- streaming: ``--chunks`` content events, each written on its own (one ``send()`` each, as a
  vLLM worker emits one event per decode step), then the usage-only chunk when the request set
  ``stream_options.include_usage``, then ``data: [DONE]``.

It also serves ``/health``, ``/v1/models`` and an idle vLLM ``/metrics`` page (KV usage 0), so
marsproxy's health checks, probes and admission see a healthy, empty worker, as in production.

Run: ``python -m marsproxy.bench.overhead_upstream --port 9000 [--chunks 100]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from typing import Any

from aiohttp import web

MODEL = "bench-model"
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
_USAGE = {"prompt_tokens": 64, "completion_tokens": 100, "total_tokens": 164}
# An idle vLLM 0.32 worker as the scraper reads it: fresh, KV empty, 43 000 blocks of 16.
_METRICS = (
    b'# TYPE vllm:num_requests_running gauge\n'
    b'vllm:num_requests_running{engine="0",model_name="bench-model"} 0.0\n'
    b'# TYPE vllm:num_requests_waiting gauge\n'
    b'vllm:num_requests_waiting{engine="0",model_name="bench-model"} 0.0\n'
    b'# TYPE vllm:kv_cache_usage_perc gauge\n'
    b'vllm:kv_cache_usage_perc{engine="0",model_name="bench-model"} 0.0\n'
    b'# TYPE vllm:cache_config_info gauge\n'
    b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="43000"} 1.0\n'
)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def completion_body() -> bytes:
    """The non-streaming answer: a short assistant message and its usage."""
    return _dumps({
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": "ok " * 25},
            "finish_reason": "stop",
            "logprobs": None,
        }],
        "usage": _USAGE,
    })


def _chunk(delta: dict[str, Any], finish: str | None = None, *, usage: bool = False) -> bytes:
    obj: dict[str, Any] = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [] if usage else [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        ],
    }
    if usage:
        obj["usage"] = _USAGE
    return b"data: " + _dumps(obj) + b"\n\n"


def stream_events(chunks: int) -> tuple[bytes, ...]:
    """``chunks`` content events (the first carries the role, the last the finish reason)."""
    if chunks < 2:
        raise ValueError("a stream needs at least 2 chunks")
    first = _chunk({"role": "assistant", "content": ""})
    middle = [_chunk({"content": f"tok{i} "}) for i in range(chunks - 2)]
    last = _chunk({}, "stop")
    return (first, *middle, last)


USAGE_EVENT = _chunk({}, usage=True)
DONE_EVENT = b"data: [DONE]\n\n"


def make_app(chunks: int) -> web.Application:
    events = stream_events(chunks)
    body = completion_body()

    async def chat(request: web.Request) -> web.StreamResponse:
        try:
            req = json.loads(await request.read())
        except ValueError:
            return web.json_response({"error": {"message": "bad json"}}, status=400)
        if not isinstance(req, dict) or req.get("stream") is not True:
            return web.Response(body=body, content_type="application/json")
        opts = req.get("stream_options")
        usage = isinstance(opts, dict) and opts.get("include_usage") is True
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        for event in events:
            await resp.write(event)
        if usage:
            await resp.write(USAGE_EVENT)
        await resp.write(DONE_EVENT)
        await resp.write_eof()
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=_METRICS, content_type="text/plain")

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chunks", type=int, default=100, help="content events per streamed reply")
    args = p.parse_args(argv)
    # The upstream runs on the plain asyncio loop in every run, so that it costs the same
    # before and after any change to the proxy.
    asyncio.run(_serve(make_app(args.chunks), args.host, args.port))


async def _serve(app: web.Application, host: str, port: int) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    main()
