"""Command packing by hiredis for the asyncio Redis client.

redis-py's synchronous client packs commands with ``hiredis.pack_command`` (C) when hiredis is
installed; its asyncio client (8.x) always packs in Python, one encode and one bytes join per
argument, which profiled at about a third of an admission's client-side cost. Each lease
script carries a dozen arguments, so the store's connections pack with hiredis too. The
reply parser already is hiredis's when it is installed (redis-py picks it by itself).
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.exceptions import DataError

try:
    import hiredis

    HIREDIS = True
except ImportError:  # a dependency, but the pure-Python path works too (slower)
    HIREDIS = False


class _HiredisPacking:
    def pack_command(self, *args: Any) -> list[bytes]:
        # As redis-py's HiredisRespSerializer: a command name with spaces ("SCRIPT LOAD") is
        # several arguments; memoryviews are copied out.
        if isinstance(args[0], str):
            args = tuple(args[0].encode().split()) + args[1:]
        elif b" " in args[0]:
            args = tuple(args[0].split()) + args[1:]
        if any(isinstance(a, bytearray | memoryview) for a in args):
            args = tuple(bytes(a) if isinstance(a, bytearray | memoryview) else a for a in args)
        try:
            return [hiredis.pack_command(args)]
        except TypeError as exc:
            raise DataError(str(exc)) from exc


def pack_with_hiredis(client: Redis) -> bool:
    """Make ``client``'s new connections pack with hiredis; False when it is not installed."""
    if not HIREDIS:
        return False
    pool = client.connection_pool
    base = pool.connection_class
    if not issubclass(base, _HiredisPacking):
        pool.connection_class = type(f"Hiredis{base.__name__}", (_HiredisPacking, base), {})
    return True
