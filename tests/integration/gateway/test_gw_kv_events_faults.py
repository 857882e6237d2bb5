"""The KV event subscriber against publishers that misbehave, on real ZMQ and TCP sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from marsproxy.config import load_config
from marsproxy.gateway.shells.kv_events import KVEventsShell


@pytest.fixture
async def flapping() -> AsyncIterator[tuple[int, int]]:
    """Two TCP ports that are no ZMQ publisher: one closes every connection at once (a port
    some other server holds, a publisher that crash-loops), one accepts and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def close(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.close()

    async def hold(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)

    closer = await asyncio.start_server(close, "127.0.0.1", 0)
    holder = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield closer.sockets[0].getsockname()[1], holder.sockets[0].getsockname()[1]
    finally:
        for w in held:
            w.close()
        for srv in (closer, holder):
            srv.close()


async def test_a_flapping_publisher_does_not_pile_up_replay_requests(
    flapping: tuple[int, int], until: Any,
) -> None:
    # Each connection starts the index over and asks for a replay from 0. Connections came
    # every reconnect_s and each replay waited out replay_timeout_s, so the requests queued
    # without bound, to be replayed one by one long after they were superseded.
    pub, replay = flapping
    cfg = load_config(None, environ={}, overrides={
        "workers": [{"url": "http://127.0.0.1:9", "name": "w", "kv_events": {
            "endpoint": f"tcp://127.0.0.1:{pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}"}}],
        "probes": {"tuning": {"kv_events": {"reconnect_s": 0.02, "replay_timeout_s": 5.0}}}})
    shell = KVEventsShell(cfg)
    await shell.start()
    s = shell.sources["w"]
    try:
        await until(lambda: s.connects_total >= 20)  # connections to the flapping port
        assert s.replays_total == 1  # the first replay still waits for its answer
        assert s.replays.qsize() <= 1  # only the newest request is worth serving
        assert not shell.state()["w"]["usable"]
    finally:
        await shell.stop()
