"""A vLLM-shaped KV event publisher on real ZMQ sockets (PUB + replay ROUTER) for the
subscriber's tests: it sends what the test tells it, frames as given (sequence numbers and
payloads may be garbage), and its replays can be held part way or made to misbehave."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from marsproxy.config import load_config
from marsproxy.gateway.shells.kv_events import KVEventsShell
from marsproxy.probes.kv_wire import END_SEQ


class Publisher:
    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.ctx = ctx
        self.pub = ctx.socket(zmq.PUB)
        self.router = ctx.socket(zmq.ROUTER)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[bytes, bytes]] = []  # (seq frame, payload), what replay answers
        self.replays = 0  # requests served (or being served)
        self.hold_after: int | None = None  # a replay stops after this many batches until...
        self.resume = asyncio.Event()  # ...this is set
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            self.replays += 1
            await self.answer(ident, int.from_bytes(start, "big"))

    async def answer(self, ident: bytes, first: int) -> None:
        """The publisher's buffer from ``first`` on, then the end marker."""
        sent = 0
        for seq, body in list(self.buffer):
            if int.from_bytes(seq, "big") >= first:
                if sent == self.hold_after:
                    await self.resume.wait()
                await self.router.send_multipart([ident, b"", b"kv", seq, body])
                sent += 1
        await self.router.send_multipart([ident, b"", b"", END_SEQ, b""])

    async def send(self, seq: bytes, body: bytes, *, keep: bool = True) -> None:
        if keep:
            self.buffer.append((seq, body))
        await self.pub.send_multipart([b"kv", seq, body])

    async def restart_pub(self) -> None:
        """The PUB socket goes away and comes back on its port (subscribers reconnect)."""
        self.pub.close(linger=0)
        self.pub = self.ctx.socket(zmq.PUB)
        for _ in range(100):  # ZMQ closes the old listener in its own thread, a moment later
            try:
                self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
                return
            except zmq.ZMQError:
                await asyncio.sleep(0.02)
        raise AssertionError(f"port {self.pub_port} never came free")

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.pub.close(linger=0)
        self.router.close(linger=0)


def stored(first_token: int, h: int, pad: int = 0) -> bytes:
    """A batch storing one 4-token block; ``pad`` bytes of lora name make its payload large."""
    event = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
             "token_ids": list(range(first_token, first_token + 4)), "block_size": 4,
             "medium": "GPU"}
    if pad:
        event["lora_name"] = "x" * pad
    return msgpack.packb([time.time(), [event], 0])


async def subscribed(p: Publisher, until: Any, engine_blocks: int | None = None,
                     **tuning: Any) -> KVEventsShell:
    """A shell subscribed to ``p`` as worker ``w``, once its first replay is done; ``tuning``:
    ``probes.tuning.kv_events`` keys."""
    cfg = load_config(None, environ={}, overrides={
        "workers": [{"url": "http://127.0.0.1:9", "name": "w", "kv_events": {
            "endpoint": f"tcp://127.0.0.1:{p.pub_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{p.replay_port}", "topic": "kv"}}],
        "probes": {"tuning": {"kv_events": {"replay_timeout_s": 1.0, **tuning}}}})
    shell = (KVEventsShell(cfg) if engine_blocks is None
             else KVEventsShell(cfg, engine_blocks=lambda _: engine_blocks))
    await shell.start()
    await until(lambda: shell.state()["w"]["usable"])  # connected, first replay done
    return shell
