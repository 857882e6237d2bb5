"""The emulator's ``POST /v1/responses`` (vLLM 0.32's Responses API) over the emulated engine:
one reply (a message, or the function call a ``tool_choice`` forces), streamed as vLLM's event
sequence, kept in the store when it is on.

With ``background`` it is generated apart from the request, as vLLM does: kept ``queued`` until it
is done (``GET /v1/responses/{id}``), stopped by ``cancel``; not streamed, the answer is that
queued response at once; streamed, its events are kept, so the request and any ``GET
/v1/responses/{id}?stream=true&starting_after=N`` follow them live, and a client that leaves
does not stop it."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from marsproxy.emulator import responses_api as api
from marsproxy.emulator import responses_tools as tools
from marsproxy.emulator.http_util import (
    SSE_HEADERS,
    Frames,
    error_response,
    json_response,
    read_json,
    serve_one,
)
from marsproxy.emulator.openai_api import ApiError, bad_request, validation_error
from marsproxy.emulator.request import FinishedEvent, RequestError
from marsproxy.emulator.runner import EngineRunner, TokenStream
from marsproxy.emulator.tokenizer import filler_chunk, filler_text

LOG_CAP = 64
"""Streamed background responses whose events are kept for ``GET ?stream=true`` (the latest)."""


class EventLog:
    """A streamed background response's events in order (an event's index is its
    ``sequence_number``), and whether it has ended."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.closed = False
        self._changed = asyncio.Event()

    def add(self, parts: list[bytes]) -> None:
        if parts:
            self.events.extend(parts)
            self._changed.set()

    def close(self) -> None:
        self.closed = True
        self._changed.set()

    async def follow(self, start: int) -> AsyncIterator[bytes]:
        """The events from ``start`` on, as they come, until the response ended."""
        i = start
        while True:
            if i < len(self.events):
                chunk, i = b"".join(self.events[i:]), len(self.events)
                yield chunk
            elif self.closed:
                return
            else:
                self._changed.clear()  # a later add() sets it again
                await self._changed.wait()


async def _follow(request: web.Request, log: EventLog, start: int) -> web.StreamResponse:
    """Stream ``log`` from ``start``; a client that leaves stops only its own stream."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    with contextlib.suppress(ConnectionResetError):
        async for chunk in log.follow(start):
            await resp.write(chunk)
        await resp.write_eof()
    return resp


class ResponsesHandlers:
    def __init__(self, runner: EngineRunner, store: api.ResponseStore) -> None:
        self.runner, self.store = runner, store
        self.model = runner.profile.model_name
        self.block = runner.profile.block_size
        self._background: dict[str, asyncio.Task[None]] = {}  # running, by response id
        self._logs: OrderedDict[str, EventLog] = OrderedDict()  # streamed background ones

    async def responses(self, request: web.Request) -> web.StreamResponse:
        try:
            req = api.parse(await read_json(request), self.model,
                            self.runner.profile.effective_max_model_len, self.store)
        except ApiError as exc:
            return error_response(exc)
        rid, mid = "resp_" + uuid.uuid4().hex[:16], "msg_" + uuid.uuid4().hex[:16]
        call = tools.call_ids()  # used where the reply is a forced function call
        created = int(time.time())
        try:
            stream = self.runner.submit(rid, req.prompt_token_ids, req.max_tokens, False, 0)
        except RequestError as exc:
            return error_response(bad_request(str(exc)))

        def body(fin: FinishedEvent) -> dict[str, Any]:
            return self._final(req, rid, mid, call, created, fin)

        frames = (self._frames(req, rid, mid, created, body) if req.tool is None
                  else self._call_frames(req, rid, call, created, body))
        if req.background:
            queued, log = self._queue(req, rid, created, stream, body,
                                      frames if req.stream else None)
            return json_response(queued) if log is None else await _follow(request, log, 0)
        return await serve_one(request, self.runner, rid, stream, streamed=req.stream,
                               frames=frames, body=body)

    def _final(self, req: api.ResponsesRequest, rid: str, mid: str, call: tuple[str, str],
               created: int, fin: FinishedEvent) -> dict[str, Any]:
        """The finished response (a message, or the forced function call whose arguments wrap
        the text); kept when the store keeps it."""
        text = filler_text(0, fin.completion_tokens)
        status = "incomplete" if fin.finish_reason == "length" else "completed"
        reply: api.Message
        if req.tool is None:
            output, reply = api.message_item(mid, text), {"role": "assistant", "content": text}
        else:
            args = req.tool.arguments(text)
            output = tools.function_call_item(req.tool, *call, args, done=True)
            reply = tools.call_message(req.tool, call[0], args)
        final = api.response(rid, created, self.model, req, [output], status, api.usage(
            fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens, self.block))
        if req.store:
            self.store.put(rid, api.Stored(req.messages, reply, final))
        return final

    def _queue(self, req: api.ResponsesRequest, rid: str, created: int, stream: TokenStream,
               body: Callable[[FinishedEvent], dict[str, Any]],
               frames: Frames | None) -> tuple[dict[str, Any], EventLog | None]:
        """A background response: kept ``queued`` (no output, no usage; returned) until the
        engine is done, then the finished response (``body``). Streamed (``frames``), its events
        go into the log returned, which the clients follow."""
        queued = api.response(rid, created, self.model, req, [], "queued", None)
        self.store.put(rid, api.Stored(req.messages, None, queued))
        log = None if frames is None else EventLog()
        if log is not None:
            self._logs[rid] = log
            while len(self._logs) > LOG_CAP:
                self._logs.popitem(last=False)

        async def run() -> None:
            sent = 0
            try:
                while True:
                    fin = stream.finished
                    if frames is not None and log is not None:
                        parts, sent = frames(sent, stream.available, fin)
                        log.add(parts)
                    if fin is not None:
                        break
                    await stream.event.wait()
                    stream.event.clear()
                if frames is None:
                    body(fin)
            finally:  # cancelled: the engine drops the request, its followers are let go
                if log is not None:
                    log.close()
                self.runner.release(rid)
                self._background.pop(rid, None)

        self._background[rid] = asyncio.create_task(run(), name=f"emulator-background-{rid}")
        return queued, log

    async def close(self) -> None:
        """The server stops: background responses still running are dropped."""
        tasks = list(self._background.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/responses/{id}``: a kept response as it is now, else vLLM's 404; with
        ``stream=true``, a streamed background response's events after ``starting_after``,
        followed live until it ends."""
        rid = request.match_info["response_id"]
        kept = self.store.get(rid)
        if kept is None:
            return error_response(api.not_found(rid))
        if request.query.get("stream", "").lower() != "true":
            return json_response(kept.response)
        log = self._logs.get(rid)
        if log is None:
            return error_response(validation_error(f"Unknown response_id: {rid}", "response_id",
                                                   rid))
        try:
            after = int(request.query.get("starting_after", "-1"))
        except ValueError:
            return error_response(validation_error("starting_after must be an integer",
                                                   "starting_after"))
        return await _follow(request, log, max(0, after + 1))

    async def cancel(self, request: web.Request) -> web.Response:
        """``POST /v1/responses/{id}/cancel``: a background response still queued is stopped
        and kept ``cancelled``; any other is vLLM's 400 (404: not kept)."""
        rid = request.match_info["response_id"]
        kept = self.store.get(rid)
        if kept is None:
            return error_response(api.not_found(rid))
        if kept.response["status"] not in ("queued", "in_progress"):
            return error_response(api.cannot_cancel())
        cancelled = {**kept.response, "status": "cancelled"}
        self.store.put(rid, api.Stored(kept.messages, kept.reply, cancelled))
        task = self._background.get(rid)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return json_response(cancelled)

    def _frames(self, req: api.ResponsesRequest, rid: str, mid: str, created: int,
                body: Callable[[FinishedEvent], dict[str, Any]]) -> Frames:
        """``response.created``, ``in_progress``, the item and its part opened, a text delta
        per token, the text, part and item done, ``response.completed`` with usage."""
        events = api.Events()
        start = api.response(rid, created, self.model, req, [], "in_progress", None)

        def frames(sent: int, avail: int, fin: FinishedEvent | None) -> tuple[list[bytes], int]:
            parts = [] if events.seq else events.opening(start, mid)
            parts.extend(events.delta(mid, filler_chunk(i)) for i in range(sent, avail))
            if fin is not None:
                parts.extend(events.closing(body(fin), mid, filler_text(0, fin.completion_tokens)))
            return parts, avail

        return frames

    def _call_frames(self, req: api.ResponsesRequest, rid: str, call: tuple[str, str],
                     created: int, body: Callable[[FinishedEvent], dict[str, Any]]) -> Frames:
        """A forced function call's stream: ``response.created``, ``in_progress``, the item
        opened, an arguments delta per token (the first opens the JSON object, the last closes
        it), the arguments and the item done, ``response.completed``."""
        tool, events = req.tool, api.Events()
        assert tool is not None
        start = api.response(rid, created, self.model, req, [], "in_progress", None)
        opened = tools.function_call_item(tool, *call, "", done=False)

        def frames(sent: int, avail: int, fin: FinishedEvent | None) -> tuple[list[bytes], int]:
            parts = [] if events.seq else events.call_opening(start, opened)
            last = avail - 1 if fin is not None else -1  # the finish comes with the last token
            parts.extend(events.call_delta(call[1], tool.piece(filler_chunk(i), i == 0, i == last))
                         for i in range(sent, avail))
            if fin is not None:
                final = body(fin)
                parts.extend(events.call_closing(final, final["output"][0]))
            return parts, avail

        return frames
