"""vLLM's KV event publisher for the emulated engine (``--kv-events-config``).

The same sockets, framing and payload as vLLM 0.32's ZMQ publisher:

- a PUB socket sends each step's events as one batch ``[topic, seq (8 bytes, big-endian),
  msgpack payload]``, sequence numbers counting from 0;
- the payload is the array ``[ts, events, data_parallel_rank]``; each event a map whose first
  key ``type`` names it, then its fields in vLLM's order, optional fields left out while None;
- a ROUTER replay socket answers ``[b"", start_seq]`` with every buffered batch from
  ``start_seq`` on (``[b"", topic, seq, payload]``) and then ``[b"", b"", -1 (8 bytes), b""]``.

As in vLLM, an endpoint with a wildcard host (``tcp://*:5557``), ``ipc://`` or ``inproc://`` is
bound and any other one connected to; the replay endpoint is always bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from marsproxy.emulator.kv_cache import BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_HASH_MASK = (1 << 64) - 1  # vLLM publishes block hashes as unsigned 64-bit ints


class StartError(Exception):
    """The emulated worker cannot start: its port or a KV event endpoint is taken or unusable
    (the message names which)."""


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields, with its defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null"; unset: zmq when events are enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    @property
    def resolved_publisher(self) -> str:
        if self.publisher is None:
            return "zmq" if self.enable_kv_cache_events else "null"
        return self.publisher

    def source(self) -> dict[str, Any]:
        """The publisher's entry in ``GET /kv_event_sources``."""
        return {**asdict(self), "publisher": self.resolved_publisher}


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The flag's JSON object; ValueError on anything vLLM would refuse."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--kv-events-config is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    fields = KVEventsConfig.__dataclass_fields__
    unknown = sorted(set(obj) - set(fields))
    if unknown:
        raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}")
    cfg = KVEventsConfig(**obj)
    if cfg.resolved_publisher not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: unknown publisher {cfg.publisher!r}")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"--kv-events-config: {name} must be a non-negative int")
    for name in ("endpoint", "replay_endpoint"):
        v = getattr(cfg, name)
        if v is None and name == "replay_endpoint":
            continue
        if not isinstance(v, str) or not v.startswith(("tcp://", "ipc://", "inproc://")) or (
                v.startswith("tcp://") and not v.rpartition(":")[2].isdigit()):
            raise ValueError(f"--kv-events-config: {name} {v!r} is not a ZMQ address such as"
                             " tcp://*:5557")
    return cfg


def encode_event(ev: KVEvent, block_size: int) -> dict[str, Any]:
    """One event as vLLM's msgspec encoder writes it (a map, ``type`` first)."""
    if isinstance(ev, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [h & _HASH_MASK for h in ev.block_hashes],
            "parent_block_hash": None if ev.parent is None else ev.parent & _HASH_MASK,
            "token_ids": ev.token_ids,
            "block_size": block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None,
            "extra_keys": [None] * len(ev.block_hashes),  # no cache salt, LoRA or images
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
        if ev.session_id is not None:
            out["session_id"] = ev.session_id
        return out
    assert isinstance(ev, BlockRemoved)
    return {"type": "BlockRemoved", "block_hashes": [ev.block_hash & _HASH_MASK],
            "medium": MEDIUM, "group_idx": 0}


def encode_batch(ts: float, events: list[KVEvent], block_size: int) -> bytes:
    payload = [ts, [encode_event(e, block_size) for e in events], 0]
    return msgpack.packb(payload, use_bin_type=True)  # type: ignore[no-any-return]


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """PUB + replay sockets of one emulated engine; ``publish`` never blocks (a subscriber that
    does not keep up loses batches at the high-water mark, as with vLLM)."""

    def __init__(self, cfg: KVEventsConfig, block_size: int) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self._ctx = zmq.asyncio.Context()
        self._topic = cfg.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, cfg.buffer_steps))
        self._seq = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay: zmq.asyncio.Socket | None = None
        field = "endpoint"
        try:
            if _binds(cfg.endpoint):
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            if cfg.replay_endpoint:
                field = "replay_endpoint"
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            addr = getattr(cfg, field)
            verb = "bind" if field == "replay_endpoint" or _binds(addr) else "connect to"
            why = zmq.strerror(exc.errno) if exc.errno else str(exc)  # without the address
            raise StartError(f"--kv-events-config: cannot {verb} {field} {addr!r}: {why}"
                             ) from None
        self._task: asyncio.Task[None] | None = None
        self.published_total = 0

    def start(self) -> None:
        if self._replay is not None:
            self._task = asyncio.create_task(self._serve_replay(), name="emulator-kv-replay")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def publish(self, events: list[KVEvent]) -> None:
        """Send one step's events as the next batch (nothing for a step without events)."""
        if not events:
            return
        payload = encode_batch(time.time(), events, self.block_size)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):  # at the high-water mark: dropped, as vLLM's
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload],
                                     flags=zmq.NOBLOCK)
        self.published_total += 1

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await sock.send_multipart(
                        [client, b"", self._topic, seq.to_bytes(8, "big"), payload])
            await sock.send_multipart([client, b"", b"", END_SEQ, b""])
