"""The Redis store's leader lease and the windows the leader publishes: the last windows read
serve while Redis is away or lost them."""

from __future__ import annotations

from collections.abc import Mapping

from redis.asyncio import Redis

from marsproxy.aimd.stores.base import WindowRecord
from marsproxy.aimd.stores.redis_keys import Arg, Keys, Scripts
from marsproxy.aimd.stores.redis_link import FAILURES, RedisLink


class RedisWindows:
    """Mixin of :class:`~.redis_store.RedisStore`; the attributes below are set there."""

    link: RedisLink
    keys: Keys
    scripts: Scripts
    redis: Redis
    _id: str
    _leader_ms: int
    _lead_until: int
    _windows: dict[str, WindowRecord]

    async def try_lead(self, now_ms: int) -> bool:
        if self.link.up:
            args: list[Arg] = [self._id, self._leader_ms]
            try:
                ok = bool(await self.link.io(self.scripts.lead(keys=[self.keys.leader], args=args)))
            except FAILURES as exc:
                self.link.fail(exc)
            else:
                # now_ms precedes the key's own start, so this belief ends before the key does.
                self._lead_until = now_ms + self._leader_ms if ok else 0
                return ok
        self._lead_until = 0  # leadership cannot be proven: nobody adapts the windows
        return False

    async def publish_windows(self, windows: Mapping[str, WindowRecord]) -> bool:
        if not self.link.up:
            return False
        args: list[Arg] = [self._id]
        for worker, rec in windows.items():
            args += [worker, rec.to_json()]
        keys = [self.keys.leader, self.keys.windows]
        try:
            ok = bool(await self.link.io(self.scripts.publish_windows(keys=keys, args=args)))
        except FAILURES as exc:
            self.link.fail(exc)
            return False
        if ok:
            self._windows = dict(windows)
        return ok

    async def read_windows(self) -> dict[str, WindowRecord]:
        if self.link.up:
            try:
                raw = await self.link.io(self.redis.hgetall(self.keys.windows))
            except FAILURES as exc:
                self.link.fail(exc)
            else:
                # Empty after a Redis restart lost it: the last windows serve until the leader
                # publishes again (a leader never publishes an empty set).
                if raw:
                    self._windows = {str(w): WindowRecord.from_json(v) for w, v in raw.items()}
        return dict(self._windows)
