"""The KV event subscriber's replays and byte caps against publishers that misbehave, on real
ZMQ and TCP sockets: a replay overtaken by a reconnection, a replay without end, frames and
held batches too large."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from marsproxy.probes.kv_wire import seq_frame

from .kv_publisher import Publisher, stored, subscribed


class _Endless(Publisher):
    """A replay socket whose answer never ends: a batch every millisecond, in sequence."""

    async def answer(self, ident: bytes, first: int) -> None:
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # stop once the subscriber hangs up
        seq = first
        try:
            while True:
                await self.router.send_multipart(
                    [ident, b"", b"kv", seq_frame(seq), stored(10 * seq, seq + 1)])
                seq += 1
                await asyncio.sleep(0.001)
        except zmq.ZMQError:
            return


async def _publisher(kind: type[Publisher]) -> AsyncIterator[Publisher]:
    ctx = zmq.asyncio.Context()
    p = kind(ctx)
    try:
        yield p
    finally:
        await p.close()
        ctx.destroy(linger=0)


@pytest.fixture
async def publisher() -> AsyncIterator[Publisher]:
    async for p in _publisher(Publisher):
        yield p


@pytest.fixture
async def endless() -> AsyncIterator[Publisher]:
    async for p in _publisher(_Endless):
        yield p


def _block(first: int) -> list[int]:
    return list(range(first, first + 4))


async def test_a_replay_overtaken_by_a_reconnection_feeds_nothing_into_the_new_index(
    publisher: Publisher, until: Any,
) -> None:
    # The subscriber reconnected (to a restarted worker) while a replay of the old history was
    # still coming: the index, started over, held the old batches and, at that replay's end,
    # resynced onto them, believing blocks of a process that no longer exists.
    shell = await subscribed(publisher, until, reconnect_s=0.05, replay_timeout_s=5.0)
    try:
        publisher.buffer += [(seq_frame(s), stored(10 * s, s + 1)) for s in range(6)]
        publisher.hold_after = 3
        await publisher.send(seq_frame(6), stored(60, 7))  # a gap: replay from 0
        await until(lambda: shell.state()["w"]["last_seq"] == 2)  # the replay is held there
        await publisher.restart_pub()  # a new process, with its own history
        publisher.buffer[:] = [(seq_frame(s), stored(100 + 10 * s, 101 + s)) for s in range(2)]
        await until(lambda: shell.state()["w"]["connects_total"] == 2)
        publisher.resume.set()  # the old replay goes on: 3, 4, 5, its end
        # the first replay was at the connection
        await until(lambda: publisher.replays == 3 and shell.state()["w"]["usable"])
        state = shell.state()["w"]
        assert [shell.resident_prefix_tokens("w", _block(10 * s)) for s in range(7)] == [0] * 7
        assert shell.resident_prefix_tokens("w", _block(100)) == 4
        assert shell.resident_prefix_tokens("w", _block(110)) == 4
        assert state["stale_replay_batches_total"] >= 1 and state["last_seq"] == 1
    finally:
        await shell.stop()


async def test_a_replay_that_never_ends_is_cut_off(endless: Publisher, until: Any) -> None:
    # Every frame came within replay_timeout_s and none was the end marker: the worker had no
    # usable index for as long as the publisher kept sending.
    shell = await subscribed(endless, until, max_pending_batches=20)
    try:
        state = shell.state()["w"]
        # 20 batches (nothing held: max_pending_batches in all), then the index stopped it
        assert state["replays_cut_total"] == 1 and state["last_seq"] == 19
        assert state["resyncs_total"] == 0  # no gap was left open: what it sent is kept
        await endless.send(seq_frame(20), stored(5000, 5001))  # live batches go on from there
        await until(lambda: shell.resident_prefix_tokens("w", _block(5000)) == 4)
        assert shell.resident_prefix_tokens("w", _block(190)) == 4 and endless.replays == 1
    finally:
        await shell.stop()


async def test_a_live_frame_over_the_size_cap_drops_the_connection(
    publisher: Publisher, until: Any,
) -> None:
    # Nothing bounded a frame: a publisher could make the proxy read and decode any size.
    shell = await subscribed(publisher, until, max_message_bytes=65536, reconnect_s=0.05)
    try:
        await publisher.send(seq_frame(0), stored(0, 1))
        await until(lambda: shell.state()["w"]["last_seq"] == 0)
        await publisher.send(seq_frame(1), stored(10, 2, pad=100_000), keep=False)
        await until(lambda: shell.state()["w"]["connects_total"] == 2
                    and shell.state()["w"]["usable"])  # started over, replayed from 0
        assert shell.resident_prefix_tokens("w", _block(10)) == 0
        assert shell.resident_prefix_tokens("w", _block(0)) == 4
        assert shell.state()["w"]["bad_frames_total"] == 1  # ZMQ does not reconnect by itself
    finally:
        await shell.stop()


async def test_a_replayed_frame_over_the_size_cap_ends_the_replay(
    publisher: Publisher, until: Any,
) -> None:
    shell = await subscribed(publisher, until, max_message_bytes=65536)
    try:
        publisher.buffer += [(seq_frame(0), stored(0, 1)),
                             (seq_frame(1), stored(10, 2, pad=100_000)),
                             (seq_frame(2), stored(20, 3))]
        await publisher.send(seq_frame(3), stored(30, 4))  # a gap: replay from 0
        # the replay stops at 1 (its connection dropped) and times out: 0 is forgotten
        await until(lambda: shell.state()["w"]["last_seq"] == 3 and shell.state()["w"]["usable"])
        assert shell.resident_prefix_tokens("w", _block(10)) == 0
        assert shell.resident_prefix_tokens("w", _block(0)) == 0
        assert shell.resident_prefix_tokens("w", _block(30)) == 4
        assert shell.state()["w"]["resyncs_total"] == 1
    finally:
        await shell.stop()


async def test_held_batches_over_the_byte_cap_resync(publisher: Publisher, until: Any) -> None:
    # Held batches were bounded by count only: 10,000 of them, each as large as a frame may be.
    shell = await subscribed(publisher, until, max_pending_bytes=100_000, replay_timeout_s=30.0)
    try:
        await publisher.send(seq_frame(0), stored(0, 1))
        await until(lambda: shell.state()["w"]["last_seq"] == 0)
        publisher.buffer.append((seq_frame(1), stored(10, 2)))
        publisher.hold_after = 0  # the replay of 1 does not come yet
        for s in range(2, 5):  # 3 x 40 kB held
            await publisher.send(seq_frame(s), stored(10 * s, s + 1, pad=40_000))
        await until(lambda: shell.state()["w"]["resyncs_total"] == 1)
        state = shell.state()["w"]
        assert state["pending"] == 0 and state["last_seq"] == 4
        assert state["pending_overflows_total"] == 1
        publisher.resume.set()
        await until(lambda: shell.state()["w"]["usable"])
        assert shell.resident_prefix_tokens("w", _block(0)) == 0  # forgotten at the resync
        assert shell.resident_prefix_tokens("w", _block(40)) == 4
    finally:
        await shell.stop()
