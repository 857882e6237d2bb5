"""Coalesces concurrent script calls into one pipeline round trip.

Under load many coroutines admit and release at once; one ``EVALSHA`` per round trip spends
most of its time in the client (asyncio and parsing per call), so calls that arrive while a
batch is in flight ride together in the next one. Each script still runs atomically on its
own; a batch only shares the round trip. At low load a batch is one call: no added wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

from marsproxy.aimd.stores.redis_errors import refusal
from marsproxy.aimd.stores.redis_keys import Arg

_MAX_BATCH = 256  # bounds one pipeline's size and the wait of the last call in it

Call = tuple[AsyncScript, Sequence[str], Sequence[Arg], "asyncio.Future[Any]"]


class ScriptBatcher:
    def __init__(self, redis: Redis, timeout_s: float) -> None:
        self._redis = redis
        self._timeout_s = timeout_s
        self._pending: list[Call] = []
        self._sender: asyncio.Task[None] | None = None
        self._busy = False  # a round trip (inline or the sender task) is in flight

    async def run(self, script: AsyncScript, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        try:
            return await self._run(script, keys, args)
        except ResponseError as exc:  # a refusing server reads as an outage, like the link's ops
            refused = refusal(exc)
            if refused is None:
                raise
            raise refused from exc

    async def _run(self, script: AsyncScript, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        if self._busy:  # a round trip is in flight: ride the next one
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._pending.append((script, keys, args, fut))
            return await fut
        # Idle: send this call alone, inline (a task per call would cost more than it saves).
        self._busy = True
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._one(script, keys, args)
        finally:
            if self._pending:
                self._sender = asyncio.create_task(self._send_all(), name="redis-script-batch")
            else:
                self._busy = False

    async def _one(self, script: AsyncScript, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        try:
            return await self._redis.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            script.sha = await self._redis.script_load(script.script)
            return await self._redis.evalsha(script.sha, len(keys), *keys, *args)

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.wait([self._sender], timeout=1.0)  # bounded: never hang a shutdown
        for *_, fut in self._pending:
            fut.cancel()
        self._pending.clear()
        self._busy = False

    async def _send_all(self) -> None:
        try:
            while self._pending:
                batch = self._pending[:_MAX_BATCH]
                del self._pending[:_MAX_BATCH]
                try:
                    async with asyncio.timeout(self._timeout_s):
                        results = await self._send(batch)
                except asyncio.CancelledError:
                    for *_, fut in batch:
                        fut.cancel()
                    raise
                except Exception as exc:  # the round trip failed: every caller sees why
                    for *_, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                for (*_, fut), res in zip(batch, results, strict=True):
                    if fut.done():  # the caller gave up (cancelled)
                        continue
                    if isinstance(res, Exception):
                        fut.set_exception(res)
                    else:
                        fut.set_result(res)
        finally:
            self._sender = None
            self._busy = False

    async def _send(self, batch: list[Call]) -> list[Any]:
        results = await self._pipeline(batch)
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:  # a restarted Redis forgot the scripts: load them, resend those calls
            for script in {id(batch[i][0]): batch[i][0] for i in missing}.values():
                script.sha = await self._redis.script_load(script.script)
            again = await self._pipeline([batch[i] for i in missing])
            for i, r in zip(missing, again, strict=True):
                results[i] = r
        return results

    async def _pipeline(self, batch: list[Call]) -> list[Any]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for script, keys, args, _ in batch:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))
