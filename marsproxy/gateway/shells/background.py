"""Calls that go on after their reply: Responses created with ``background: true``.

vLLM answers such a call at once with the response ``queued`` (no output, no usage) and
generates it afterwards; the client polls ``GET /v1/responses/{id}`` or cancels it. Streamed, the
generation goes on when the client leaves mid-stream: the same then. Ending the call when that
first reply leaves would tell admission the session is in a tool phase while the engine still
fills its KV, and the answer rule would never see the reply. So the call stays open: the proxy
asks the worker for the response every ``health.interval_s`` (at once after a client's own
``GET`` or ``cancel`` of it has passed through) until its status says it has ended, then ends
the call with the final response (its usage, its kind); a failed or cancelled one ends it as an
error does. A response still unfinished after ``upstream.first_byte_timeout_s`` (the longest a
non-streamed call may take to its whole reply), one the worker no longer knows, a worker that
does not answer ``health.unhealthy_after`` times in a row (as a health check would eject it), or
a proxy shutting down ends the call without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import quote

import aiohttp

from marsproxy.gateway.http.reply_kind import RESPONSE_ENDS

log = logging.getLogger("marsproxy.gateway.shells.background")

# The statuses of a response the worker is still working on (vLLM 0.32 shows ``queued`` until
# the end; ``in_progress`` is the OpenAI API's word for the same).
UNFINISHED = frozenset({"queued", "in_progress"})

# Called once per watched call: the final response's bytes where it ended with a reply
# (``completed``, ``incomplete``), else None (failed, cancelled, lost, given up).
Finish = Callable[[bytes | None], None]


@dataclass
class _Watch:
    url: str
    auth: dict[str, str]
    finish: Finish
    deadline: float
    wake: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True, slots=True)
class _Answer:
    """One ask's outcome: whether the worker answered, and the response's end if it has one."""

    answered: bool
    ended: bool = False
    body: bytes | None = None  # an end with a reply


class BackgroundCalls:
    """The open calls of background responses, each polled until its response has ended."""

    def __init__(
        self, http: Callable[[], aiohttp.ClientSession | None], *, interval_s: float,
        request_timeout_s: float, limit_s: float, unanswered: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._http = http
        self._interval_s, self._request_timeout_s, self._limit_s = (
            interval_s, request_timeout_s, limit_s)
        self._unanswered = unanswered
        self._now = clock
        self._watched: dict[str, _Watch] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def __len__(self) -> int:
        return len(self._watched)

    def watch(self, worker_url: str, response_id: str, auth: dict[str, str],
              finish: Finish) -> None:
        """Keep the call of ``response_id`` (made by the worker at ``worker_url``) open until
        its response ends; then ``finish`` gets it, once."""
        if response_id in self._watched:  # a worker reusing an id: the older call ends now
            self._end(response_id, None)
        self._watched[response_id] = _Watch(f"{worker_url.rstrip('/')}/v1/responses/"
                                            f"{quote(response_id, safe='')}", auth, finish,
                                            self._now() + self._limit_s)
        self._tasks[response_id] = asyncio.create_task(
            self._poll(response_id), name=f"marsproxy-background-{response_id[:32]}")

    def poke(self, response_id: str) -> None:
        """A client's request on ``response_id`` passed through: ask the worker now."""
        w = self._watched.get(response_id)
        if w is not None:
            w.wake.set()

    async def close(self) -> None:
        """Shutting down: every open call ends, without its final response."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for rid in list(self._watched):
            self._end(rid, None)

    async def _poll(self, rid: str) -> None:
        try:
            await self._until_ended(rid)
        except Exception:  # a bug here must not hold the call open for good
            log.exception("watching background response %s failed; its call ends", rid[:64])
            self._end(rid, None)

    async def _until_ended(self, rid: str) -> None:
        w, missed = self._watched[rid], 0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval_s):
                    await w.wake.wait()
            w.wake.clear()
            answer = await self._ask(rid, w)
            if answer.ended:
                self._end(rid, answer.body)
                return
            missed = 0 if answer.answered else missed + 1
            if missed >= self._unanswered:  # as a worker ejected: its calls are lost
                log.warning("background response %s: its worker did not answer %d times;"
                            " its call ends without it", rid[:64], missed)
                self._end(rid, None)
                return
            if self._now() >= w.deadline:
                log.warning("background response %s: not ended after %.0f s"
                            " (upstream.first_byte_timeout_s); its call ends without it",
                            rid[:64], self._limit_s)
                self._end(rid, None)
                return

    async def _ask(self, rid: str, w: _Watch) -> _Answer:
        http = self._http()
        if http is None:
            return _Answer(answered=False)
        try:
            async with asyncio.timeout(self._request_timeout_s), http.get(
                    w.url, headers=w.auth) as r:
                if r.status == 404:  # the worker restarted, or dropped it: nothing to wait for
                    log.info("background response %s: the worker no longer keeps it", rid[:64])
                    return _Answer(answered=True, ended=True)
                if r.status != 200:
                    return _Answer(answered=False)
                body = await r.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.info("asking for background response %s failed: %r", rid[:64], exc)
            return _Answer(answered=False)
        status = _status(body)
        if status in UNFINISHED:
            return _Answer(answered=True)
        return _Answer(answered=True, ended=True,
                       body=body if status in RESPONSE_ENDS else None)

    def _end(self, rid: str, body: bytes | None) -> None:
        w = self._watched.pop(rid, None)
        task = self._tasks.pop(rid, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        if w is None:
            return
        try:
            w.finish(body)
        except Exception:  # the end of one call must not stop the others' watch
            log.exception("ending the call of background response %s failed", rid[:64])


def unfinished(body: bytes) -> bool:
    """Whether a Responses object's bytes say the worker is still generating it."""
    return _status(body) in UNFINISHED


def _status(body: bytes) -> object:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return obj.get("status") if isinstance(obj, dict) else None
