"""The KV event subscriber against publishers that misbehave, on real ZMQ and TCP sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from marsproxy.config import load_config
from marsproxy.gateway.shells.kv_events import KVEventsShell
from marsproxy.probes.kv_wire import seq_frame

from .kv_publisher import Publisher, stored, subscribed


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


@pytest.fixture
async def publisher() -> AsyncIterator[Publisher]:
    ctx = zmq.asyncio.Context()
    p = Publisher(ctx)
    try:
        yield p
    finally:
        await p.close()
        ctx.destroy(linger=0)


async def test_a_garbage_sequence_number_does_not_end_the_index(
    publisher: Publisher, until: Any,
) -> None:
    # A live sequence frame that reads negative (2**64 - 5 unsigned) was taken for a restart:
    # the index forgot the real blocks, believed the junk batch's and went on from -5; its next
    # gap asked for a replay from -4, which cannot be encoded: the replay task died and the
    # worker never had a usable index again.
    shell = await subscribed(publisher, until)
    try:
        await publisher.send(seq_frame(0), stored(0, 1))
        await until(lambda: shell.state()["w"]["last_seq"] == 0)
        await publisher.send((2**64 - 5).to_bytes(8, "big"), stored(100, 9), keep=False)
        await publisher.send(seq_frame(1), stored(10, 2))
        await publisher.send(seq_frame(2), stored(20, 3))
        await until(lambda: shell.resident_prefix_tokens("w", list(range(20, 24))) == 4)
        assert shell.resident_prefix_tokens("w", list(range(0, 4))) == 4
        assert shell.resident_prefix_tokens("w", list(range(10, 14))) == 4
        assert shell.resident_prefix_tokens("w", list(range(100, 104))) == 0
        assert shell.state()["w"]["bad_frames_total"] == 1
    finally:
        await shell.stop()


async def test_an_unreadable_batch_in_the_replay_costs_only_what_it_may_have_changed(
    publisher: Publisher, until: Any,
) -> None:
    # One garbage payload in the publisher's buffer ended every replay there: the batches after
    # it were never applied, and each later gap asked again and failed the same way.
    shell = await subscribed(publisher, until)
    try:
        for seq, body in enumerate([stored(0, 1), b"\xc1garbage", stored(10, 2)]):
            publisher.buffer.append((seq_frame(seq), body))
        await publisher.send(seq_frame(3), stored(20, 3))  # a gap: replay from 0
        await until(lambda: shell.state()["w"]["last_seq"] == 3 and shell.state()["w"]["usable"])
        # batch 1 may have removed block 1: forgotten; 2 and 3 applied
        assert shell.resident_prefix_tokens("w", list(range(0, 4))) == 0
        assert shell.resident_prefix_tokens("w", list(range(10, 14))) == 4
        assert shell.resident_prefix_tokens("w", list(range(20, 24))) == 4
    finally:
        await shell.stop()


async def test_the_index_holds_no_more_blocks_than_the_worker_has(
    publisher: Publisher, until: Any,
) -> None:
    # The removals never come (lost, or never published): the index grew without bound.
    shell = await subscribed(publisher, until, engine_blocks=2)
    try:
        for seq in range(5):
            await publisher.send(seq_frame(seq), stored(10 * seq, seq + 1))
        await until(lambda: shell.state()["w"]["last_seq"] == 4)
        state = shell.state()["w"]
        assert state["blocks"] == {"GPU": 2} and state["dropped_blocks_total"] == 3
        assert state["engine_blocks"] == 2
        assert shell.resident_prefix_tokens("w", list(range(40, 44))) == 4
    finally:
        await shell.stop()


async def test_a_burst_of_batches_lets_the_proxy_serve_between_them(
    publisher: Publisher, until: Any,
) -> None:
    # Batches already queued on the socket were read and applied back to back without giving
    # the event loop back: a burst of 10,000 events held every request for tens of ms.
    shell = await subscribed(publisher, until)
    seen: set[int | None] = set()
    n = 40

    async def serve() -> None:  # what the request path sees, each time it gets to run
        while True:
            seen.add(shell.state()["w"]["last_seq"])
            await asyncio.sleep(0)

    server = asyncio.create_task(serve())
    try:
        for seq in range(n):  # queued on the socket at once
            await publisher.send(seq_frame(seq), stored(10 * seq, seq + 1))
        await until(lambda: shell.state()["w"]["last_seq"] == n - 1)
        assert len(seen - {None}) >= n // 2  # it ran between most batches
    finally:
        server.cancel()
        await shell.stop()


async def test_a_replay_with_its_own_gap_resyncs_after_it(
    publisher: Publisher, until: Any,
) -> None:
    """The publisher's buffer lost batch 1: what came before it may since have been removed."""
    shell = await subscribed(publisher, until)
    try:
        publisher.buffer += [(seq_frame(0), stored(0, 1)), (seq_frame(2), stored(20, 3))]
        await publisher.send(seq_frame(3), stored(30, 4))  # a gap: replay from 0
        await until(lambda: shell.state()["w"]["last_seq"] == 3 and shell.state()["w"]["usable"])
        assert shell.resident_prefix_tokens("w", list(range(0, 4))) == 0
        assert shell.resident_prefix_tokens("w", list(range(20, 24))) == 4
        assert shell.resident_prefix_tokens("w", list(range(30, 34))) == 4
        assert shell.state()["w"]["resyncs_total"] == 1
    finally:
        await shell.stop()
