"""The wire form of vLLM's KV cache events (``--kv-events-config``), read side.

vLLM's publisher sends each batch as a three-frame ZMQ message on a PUB socket::

    [topic, sequence number (8 bytes, big-endian, unsigned), payload (msgpack)]

The payload is a batch encoded as a msgpack *array* ``[ts, events, data_parallel_rank]`` (the
last element is left out when it is unset). Each event is a msgpack *map* whose first key
``"type"`` names the event (``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``),
followed by the event's fields by name; optional fields that hold their default (None) are
left out. Block hashes are unsigned 64-bit ints by default (bytes when vLLM runs with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); both are accepted and kept as they come.

The replay socket (ROUTER) answers a request ``[b"", start_seq (8 bytes)]`` from a DEALER with
every buffered batch from ``start_seq`` on, each as ``[b"", topic, seq, payload]``, then an end
marker ``[b"", b"", END_SEQ, b""]`` whose sequence number is -1 as a signed 8-byte int.

An event the decoder cannot read (unknown type, a field of the wrong type) does not cost its
batch: it becomes :class:`Unreadable`, which the index counts (and, where it may have removed
blocks, answers by forgetting them all). Only a payload that is not a batch at all is a
:class:`WireError`.

Pure code: bytes in, events out. Token ids are kept (the index turns them into chain keys);
nothing else of a request is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

END_SEQ = (-1).to_bytes(8, "big", signed=True)

BlockHash = int | bytes


class WireError(ValueError):
    """A frame or payload that is not a KV event batch of the known form."""


@dataclass(slots=True)  # not frozen: a frozen __init__ costs a fifth of decoding
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None
    session_id: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    # Some block's hash also covers more than its tokens (cache salt, multimodal input): such
    # blocks never match a prompt by token ids alone.
    salted: bool = False


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True, slots=True)
class Unreadable:
    """An event the decoder could not read; ``removes``: it may have removed blocks (which
    ones is unknown)."""

    reason: str
    removes: bool


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | Unreadable


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


def seq_of(frame: bytes) -> int:
    """The sequence number frame as an int (signed: the replay end marker reads -1)."""
    if len(frame) != 8:
        raise WireError(f"sequence frame has {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)


def batch_seq(frame: bytes) -> int:
    """A batch's sequence number: vLLM counts from 0, unsigned; one that reads negative (2**63
    and over) is garbage, not a restart."""
    seq = seq_of(frame)
    if seq < 0:
        raise WireError(f"sequence number {seq} is negative")
    return seq


def unreadable_batch(ts: float, reason: str) -> EventBatch:
    """What stands in for a batch whose sequence number was readable and its payload not: it
    may have removed any block."""
    return EventBatch(ts, (Unreadable(reason, removes=True),))


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends to ask the replay socket for batches from ``start_seq`` on."""
    return [b"", seq_frame(start_seq)]


def decode_batch(payload: bytes) -> EventBatch:
    """A batch from its msgpack payload; :class:`WireError` when it is not one."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as exc:  # TypeError: a map keyed by an array
        raise WireError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise WireError("payload is not a [ts, events, ...] array")
    ts, events = raw[0], raw[1]
    if not isinstance(ts, int | float):
        raise WireError("batch ts is not a number")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return EventBatch(float(ts) if math.isfinite(ts) else math.nan,
                      tuple(map(_event, events)), rank)


_INT, _HASH = frozenset((int,)), frozenset((int, bytes))


def _hashes(v: Any) -> tuple[BlockHash, ...]:
    if type(v) is not list or not {*map(type, v)} <= _HASH:
        raise WireError("block_hashes is not a list of ints or bytes")
    return tuple(v)


def _opt_str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _medium(v: Any) -> str | None:
    if v is not None and not isinstance(v, str):  # read as GPU, it would count in the wrong pool
        raise WireError(f"medium is {type(v).__name__}, not a name")
    return v


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _salted(extra: Any) -> bool:
    return isinstance(extra, list) and any(k is not None for k in extra)


def _event(e: Any) -> KVEvent:
    if not isinstance(e, dict):  # vLLM 0.32 encodes events as maps, never as arrays
        return Unreadable("event is not a map", removes=True)
    kind = e.get("type")
    try:
        ev = _known_event(kind, e)
    except WireError as exc:  # a store skipped loses nothing; a removal skipped might
        return Unreadable(f"{kind}: {exc}", removes=kind != "BlockStored")
    # A type of a later vLLM: what it means is unknown, what the index knows stays true.
    return Unreadable(f"unknown event type {kind!r}"[:200], removes=False) if ev is None else ev


def _known_event(kind: Any, e: dict[Any, Any]) -> KVEvent | None:
    if kind == "BlockStored":
        tokens, parent, size = e.get("token_ids"), e.get("parent_block_hash"), e.get("block_size")
        if type(tokens) is not list or not {*map(type, tokens)} <= _INT:
            raise WireError("BlockStored.token_ids is not a list of ints")
        if parent is not None and not isinstance(parent, int | bytes):
            raise WireError("BlockStored.parent_block_hash is not an int, bytes or null")
        if type(size) is not int or size <= 0:
            raise WireError("BlockStored.block_size is not a positive int")
        return BlockStored(
            block_hashes=_hashes(e.get("block_hashes")), parent_block_hash=parent,
            token_ids=tuple(tokens), block_size=size, medium=_medium(e.get("medium")),
            session_id=_opt_str(e.get("session_id")), lora_name=_opt_str(e.get("lora_name")),
            group_idx=_opt_int(e.get("group_idx")),
            salted=_salted(e.get("extra_keys")),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(e.get("block_hashes")), _medium(e.get("medium")),
                            _opt_int(e.get("group_idx")))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None
