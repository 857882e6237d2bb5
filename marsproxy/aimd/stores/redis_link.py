"""The Redis connection of a store: timeouts, outage detection, reconnect, wake-up listener.

Kept apart from :mod:`.redis_store` so that the store reads as admission semantics only. The
link decides *whether* Redis is usable; the store decides what to do meanwhile
(``on_store_failure``) and how to write its local view back (``on_recover``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import ResponseError

from marsproxy.aimd.stores.config import StoreConfig
from marsproxy.aimd.stores.redis_batch import ScriptBatcher
from marsproxy.aimd.stores.redis_conn import check_at_start, close_clients, make_clients
from marsproxy.aimd.stores.redis_errors import FAILURES, refusal
from marsproxy.aimd.stores.redis_keys import Keys, Scripts
from marsproxy.aimd.stores.redis_pack import pack_with_hiredis

log = logging.getLogger(__name__)
T = TypeVar("T")

# What ends one wake-up subscription (a new one follows): an outage, or a refusal such as DENIED.
_SUB_ERRORS: tuple[type[BaseException], ...] = (*FAILURES, ResponseError)

__all__ = ["FAILURES", "RedisLink", "raise_if_cancelled"]


class RedisLink:
    def __init__(
        self,
        config: StoreConfig,
        on_recover: Callable[[], Awaitable[str]],
        on_wakeup: Callable[[], None],
    ) -> None:
        self.cfg = config
        self.keys = Keys.for_pool(config.key_prefix, config.pool)
        self.clients = make_clients(config)
        self.redis, self._sub = self.clients.redis, self.clients.sub
        pack_with_hiredis(self.redis)
        self.scripts = Scripts(self.redis)
        self.batch = ScriptBatcher(self.redis, config.op_timeout_s)
        self.up = True
        self.failures_total = 0
        self._on_recover = on_recover
        self._on_wakeup = on_wakeup
        self._listener: asyncio.Task[None] | None = None
        self._closing = False
        self._reconnect: asyncio.Task[None] | None = None

    async def check(self) -> None:
        """StoreSetupError if the configuration cannot work (see :mod:`.redis_conn`)."""
        await check_at_start(self.clients, self.cfg)

    def start(self) -> None:
        self._listener = asyncio.create_task(self._listen(), name="redis-store-wakeups")

    async def close(self) -> None:
        self._closing = True
        tasks = [t for t in (self._listener, self._reconnect) if t is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)  # bounded: never hang a shutdown
        self._listener = self._reconnect = None
        await self.batch.close()
        await close_clients(self.clients)

    async def io(self, aw: Awaitable[T]) -> T:
        # asyncio.timeout, not wait_for: no extra task per op (a third of an op's cost).
        try:
            async with asyncio.timeout(self.cfg.op_timeout_s):
                return await aw
        except ResponseError as exc:
            refused = refusal(exc)
            if refused is None:
                raise
            raise refused from exc

    def fail(self, exc: BaseException) -> None:
        """Count a failed op; on the first, say so once and start reconnecting."""
        self.failures_total += 1
        if self.up:
            self.up = False
            # redis-py's repr() of its errors drops the message (why it failed): log both.
            log.warning(
                "state store: Redis at %s unusable (%s: %s); pool %r continues with "
                "on_store_failure=%s until it is back",
                self.clients.where,
                type(exc).__name__,
                exc,
                self.cfg.pool,
                self.cfg.on_store_failure,
            )
        if self._reconnect is None or self._reconnect.done():
            self._reconnect = asyncio.create_task(self._reconnect_loop(), name="redis-reconnect")

    async def _reconnect_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.reconnect_interval_s)
            try:
                await self.io(self.redis.ping())
                summary = await self._on_recover()
            except FAILURES as exc:
                log.debug("state store: Redis still unusable: %s: %s", type(exc).__name__, exc)
                continue
            except Exception:  # a bug must not end reconnecting: this replica would stay local
                log.exception("state store: resync failed; retrying")
                continue
            if self.up:  # else it failed again during the last resync pass: keep trying
                log.warning("state store: Redis is back; %s", summary)
                return

    async def _listen(self) -> None:
        me = asyncio.current_task()
        assert me is not None
        while not self._closing:
            ps = self._sub.pubsub()
            try:
                await ps.subscribe(self.keys.channel)
                raise_if_cancelled(me)
                self._on_wakeup()  # wake-ups published while unsubscribed are lost
                while not self._closing:
                    if await ps.get_message(ignore_subscribe_messages=True, timeout=None):
                        self._on_wakeup()
                    raise_if_cancelled(me)
            except _SUB_ERRORS as exc:
                # Data ops detect outages; a broken subscription only needs a new one. A
                # refusal (DENIED at connect) too: this task must outlive it, or no wake-up
                # from another replica arrives once Redis accepts this one again.
                log.debug("state store: wake-up subscription lost: %r", exc)
            finally:
                try:
                    await ps.aclose()  # type: ignore[no-untyped-call]
                except Exception as exc:  # closing a broken subscription; a new one follows
                    log.debug("state store: closing the wake-up subscription failed: %r", exc)
            raise_if_cancelled(me)
            await asyncio.sleep(self.cfg.reconnect_interval_s)


def raise_if_cancelled(task: asyncio.Task[None]) -> None:
    # redis-py (8.1, Python 3.11) can swallow a cancellation that lands inside subscribe();
    # the request stays counted on the task, so honour it here instead of reading forever.
    if task.cancelling():
        raise asyncio.CancelledError
