"""What the KV index tests build events with."""

from __future__ import annotations

from marsproxy.probes.kv_wire import BlockStored, EventBatch, KVEvent

BS = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def stored(toks: list[int], hashes: list[int], parent: int | None = None,
           session: str | None = None, medium: str = "GPU") -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(toks), BS, medium, session)


def batch(*events: KVEvent, ts: float = 100.0) -> EventBatch:
    return EventBatch(ts, tuple(events), 0)
