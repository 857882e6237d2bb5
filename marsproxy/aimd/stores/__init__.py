"""Admission state stores: in-memory for one replica, Redis for several.

Build one with :func:`make_store` from the ``store:`` config section; the gateway sees only
the :class:`WindowStore` Protocol.
"""

from __future__ import annotations

from marsproxy.aimd.stores.base import (
    ClockMs,
    HeldElsewhere,
    StoreMode,
    WindowRecord,
    WindowStore,
    wall_clock_ms,
)
from marsproxy.aimd.stores.config import FailureMode, StoreBackend, StoreConfig
from marsproxy.aimd.stores.memory import MemoryState, MemoryStore
from marsproxy.aimd.stores.redis_store import RedisStore


def make_store(
    config: StoreConfig, *, clock: ClockMs = wall_clock_ms, replica_id: str | None = None
) -> WindowStore:
    """The store ``config.backend`` names; call ``await store.start()`` before use."""
    if config.backend == "redis":
        return RedisStore(config, clock=clock, replica_id=replica_id)
    return MemoryStore(config, clock=clock, replica_id=replica_id, lone=True)


__all__ = [
    "ClockMs",
    "FailureMode",
    "HeldElsewhere",
    "MemoryState",
    "MemoryStore",
    "RedisStore",
    "StoreBackend",
    "StoreConfig",
    "StoreMode",
    "WindowRecord",
    "WindowStore",
    "make_store",
    "wall_clock_ms",
]
