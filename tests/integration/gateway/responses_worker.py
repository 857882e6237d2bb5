"""A worker that keeps its Responses replies, as vLLM with its response store on, and the
calls the Responses tests make through a gateway (test_gw_previous_response.py,
test_gw_replies_probe.py, test_gw_answers.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import aiohttp
from aiohttp import web

from marsproxy.gateway.http.app import Running

from .conftest import FakeWorker, Seen, sse
from .relay_client import url


class StoringWorker(FakeWorker):
    """Answers /v1/responses as vLLM with its response store on: each reply gets a new id,
    remembered by this worker only; a ``previous_response_id`` it never made is a 404. A
    background response stays ``queued`` until the test calls :meth:`finish` (or it is
    cancelled); ``forget`` drops a reply, as a restarted worker has."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.made: list[str] = []
        self.kept: dict[str, dict[str, Any]] = {}  # each reply as GET shows it when done
        self.running: set[str] = set()  # background replies still generating
        self._n = itertools.count(1)

    def finish(self, rid: str) -> None:
        self.running.discard(rid)

    def forget(self, rid: str) -> None:
        self.running.discard(rid)
        self.made.remove(rid)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(Seen(request.method, request.path_qs, dict(request.headers), body))
        obj = json.loads(body)
        prev = obj.get("previous_response_id")
        if prev is not None and prev not in self.made:
            return web.json_response({"error": {
                "message": f"Response with id '{prev}' not found.", "type": "invalid_request_error",
                "param": "response_id", "code": 404}}, status=404)
        rid = f"resp_{self.name}_{next(self._n)}"
        self.made.append(rid)
        resp: dict[str, Any] = {
            "id": rid, "object": "response", "status": "completed",
            "output": [{"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": f"said {rid}"}]}],
            "usage": {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7},
        }
        if request.headers.get("x-fake") == "tool":
            resp["output"] = [{"type": "function_call", "name": "run", "arguments": "{}",
                               "call_id": f"call_{rid}", "id": f"fc_{rid}"}]
        self.kept[rid] = dict(resp)
        if obj.get("background"):  # vLLM answers at once; the engine goes on generating
            self.running.add(rid)
            resp |= {"status": "queued", "output": [], "usage": None}
        if not obj.get("stream"):
            self.completed += 1
            return web.json_response(resp)
        started = {**resp, "status": "in_progress", "output": [], "usage": None}
        if obj.get("background"):
            return await self._generating(request, started, self.kept[rid])
        events = [
            ("response.created", {"type": "response.created", "response": started}),
            ("response.completed", {"type": "response.completed", "response": resp}),
        ]
        return await self._sse_events(request, events)

    async def _generating(self, request: web.Request, started: dict[str, Any],
                          done: dict[str, Any]) -> web.StreamResponse:
        """A streamed background response: deltas every 20 ms until the test finishes it;
        a client that leaves does not stop it (as vLLM's background task)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        delta = {"type": "response.output_text.delta", "delta": "x"}
        try:
            await resp.write(sse({"type": "response.created", "response": started}))
            while started["id"] in self.running:
                await asyncio.sleep(0.02)
                await resp.write(sse(delta))
            await resp.write(sse({"type": "response.completed", "response": done}))
            await resp.write_eof()
        except ConnectionError:
            pass  # the client left; the response goes on until finish()
        return resp

    async def _echo(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}`` and its ``cancel``: a kept response (``queued`` while
        it generates), or vLLM's 404 for one made elsewhere."""
        rid, _, cancel = request.path.removeprefix("/v1/responses/").partition("/")
        if (request.method, cancel) not in (("GET", ""), ("POST", "cancel")) or (
                not request.path.startswith("/v1/responses/")):
            return await super()._echo(request)
        self.seen.append(Seen(request.method, request.path_qs, dict(request.headers), b""))
        if rid not in self.made:
            return web.json_response({"error": {
                "message": f"Response with id '{rid}' not found.",
                "type": "invalid_request_error", "param": "response_id", "code": 404}},
                status=404)
        if cancel and rid in self.running:
            self.running.discard(rid)
            self.kept[rid] |= {"status": "cancelled", "output": [], "usage": None}
        if rid in self.running:
            return web.json_response(
                {**self.kept[rid], "status": "queued", "output": [], "usage": None})
        return web.json_response(self.kept.get(rid, {"id": rid, "status": "completed"}))


async def busy(http: aiohttp.ClientSession, g: Running, sid: str) -> None:
    """A chat session of its own (``sid``) on ``g``: it holds a worker, steering placement."""
    async with http.post(url(g, "/v1/chat/completions"), headers={"x-session-id": sid}, json={
            "model": "fake", "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status == 200, await r.text()


async def call(http: aiohttp.ClientSession, g: Running, body: dict[str, Any]) -> str:
    """The reply's id, read as the client reads it (the body, or the stream's events)."""
    async with http.post(url(g, "/v1/responses"), json=body) as r:
        assert r.status == 200, await r.text()
        if not body.get("stream"):
            return str((await r.json())["id"])
        text = (await r.read()).decode()
    done = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    return str(done[-1]["response"]["id"])
