"""hiredis packing for the asyncio client: the same bytes redis-py's Python packer makes."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection

from marsproxy.aimd.stores.redis_pack import HIREDIS, pack_with_hiredis

pytestmark = pytest.mark.skipif(not HIREDIS, reason="hiredis not installed")

COMMANDS: list[tuple[Any, ...]] = [
    ("EVALSHA", "a" * 40, 3, "mars:{p}:adm:w0", "mars:{p}:own:w0", "mars:{p}:ended:t/id/s",
     "t/id/s", 30, 1_800_000_000_000, 1_800_000_010_000, "3f9a0c"),
    ("SCRIPT LOAD", "return 1"),
    ("SET", "mars:{p}:sess:k", '{"worker":"w0","usual_tool_s":1.5}', "PX", 1_800_000),
    ("ZADD", b"key", 12, "s\u00e9ssion-\u4e2d"),
    ("GET", memoryview(b"mars:{p}:x")),
]


@pytest.mark.parametrize("cmd", COMMANDS)
async def test_packs_like_redis_py(cmd: tuple[Any, ...]) -> None:
    client = Redis()
    try:
        assert pack_with_hiredis(client)
        fast = client.connection_pool.make_connection()
        plain = Connection()
        assert type(fast) is not Connection and isinstance(fast, Connection)
        assert b"".join(fast.pack_command(*cmd)) == b"".join(plain.pack_command(*cmd))
        assert b"".join(fast.pack_commands([cmd, cmd])) == b"".join(
            plain.pack_commands([cmd, cmd]))
    finally:
        await client.aclose()
