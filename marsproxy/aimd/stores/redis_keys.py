"""Redis key names and the Lua scripts of the Redis store.

Every key of a pool shares the hash tag ``{pool}`` (``mars:{default}:...``), so on Redis
Cluster all keys a script touches live in one slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

# What scripts take as ARGV.
Arg = str | int | float


@dataclass(frozen=True, slots=True)
class Keys:
    base: str  # "{key_prefix}:{{pool}}:"

    @classmethod
    def for_pool(cls, key_prefix: str, pool: str) -> Keys:
        return cls(f"{key_prefix}:{{{pool}}}:")

    def adm(self, worker: str) -> str:
        """Lease ZSET of one worker: session scored by lease expiry (epoch ms)."""
        return f"{self.base}adm:{worker}"

    def own(self, worker: str) -> str:
        """Hash session → replica id, to renew only one's own leases."""
        return f"{self.base}own:{worker}"

    @property
    def windows(self) -> str:
        return f"{self.base}windows"

    @property
    def leader(self) -> str:
        return f"{self.base}leader"

    @property
    def queue(self) -> str:
        return f"{self.base}queue"

    @property
    def tenants(self) -> str:
        """Hash tenant → virtual token counter (served tokens / weight, all replicas)."""
        return f"{self.base}tenants"

    @property
    def replicas(self) -> str:
        return f"{self.base}replicas"

    @property
    def epoch(self) -> str:
        """A random token set once per pool, never expiring: gone means the state is gone."""
        return f"{self.base}epoch"

    def session(self, key: str) -> str:
        return f"{self.base}sess:{key}"

    def reply(self, reply: str) -> str:
        """A reply id's (``reply_key``) session and worker, for a next call naming it elsewhere."""
        return f"{self.base}reply:{reply}"

    def saved(self, key: str, worker: str) -> list[str]:
        """The KEYS of ``save.lua``: the record, its worker's lease owners, its tombstone."""
        return [self.session(key), self.own(worker), self.tomb(key)]

    def tomb(self, key: str) -> str:
        """Tombstone of an ended session (resync must not write its lease back)."""
        return f"{self.tomb_prefix}{key}"

    @property
    def tomb_prefix(self) -> str:
        return f"{self.base}ended:"

    def asked(self, key: str) -> str:
        """Mark of a waiting session whose replica asked for it within one lease TTL: a queue
        entry without one is a dead replica's (``admit_ranked.lua`` drops it)."""
        return f"{self.asked_prefix}{key}"

    @property
    def asked_prefix(self) -> str:
        return f"{self.base}asked:"

    def worker_of(self, adm: str) -> str:
        """The worker whose lease ZSET ``adm`` is."""
        return adm.removeprefix(self.adm(""))

    def ranked(self, worker: str, session: str, others: Sequence[str] = ()) -> list[str]:
        """The KEYS of ``admit_ranked.lua``."""
        return [self.adm(worker), self.own(worker), self.queue, self.tomb(session),
                self.asked(session), *(self.adm(w) for w in others if w != worker)]

    @property
    def channel(self) -> str:
        return f"{self.base}wake"

    @property
    def pattern(self) -> str:
        """Matches every key of the pool (tests and ``SCAN`` clean-ups)."""
        return f"{self.base}*"


def _source(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


class Scripts:
    """The registered scripts; redis-py reloads one after NOSCRIPT (e.g. a restarted Redis)."""

    def __init__(self, client: Redis) -> None:
        lib = _source("_lib.lua")

        def lease_script(name: str) -> AsyncScript:
            return client.register_script(lib + "\n" + _source(name))

        def plain(name: str) -> AsyncScript:
            return client.register_script(_source(name))

        self.admit = lease_script("admit.lua")
        self.admit_ranked = lease_script("admit_ranked.lua")
        self.renew = lease_script("renew.lua")
        self.resync = lease_script("resync.lua")
        self.release = plain("release.lua")
        self.save = plain("save.lua")
        self.forget = plain("forget.lua")
        self.heartbeat = plain("heartbeat.lua")
        self.lead = plain("lead.lua")
        self.publish_windows = plain("publish_windows.lua")
