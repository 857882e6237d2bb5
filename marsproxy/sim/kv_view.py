"""What the gateway's KV indexes would tell the plane, built from the emulated engines.

With ``SimSetup.kv_events`` each engine records its KV cache events (as ``marsproxy emulate
--kv-events-config`` publishes them) and every finished engine step hands them, as one
sequence-numbered batch, to a :class:`marsproxy.probes.kv_index.KVIndex` per worker: the index
the gateway keeps per worker, fed the same events, only without sockets. The plane then hears
what the gateway's relay tells it (docs/kv-events.md):

- a new session's first prompt: resident prefix tokens per worker (prefix placement);
- each call: resident prefix tokens of its prompt on its worker (retention verified);
- each tick: resident blocks per session and worker (the resident-block KV fit, the ledger
  correction).

The index keys blocks by a chain over token ids (``chain_keys``); the engine's block hashes are
the same chain (``hash((parent, block_tokens))`` from 0), so a prompt the engine would find in
its prefix cache is one the index finds resident (tests/unit/sim/test_kv_view.py).

Events become visible when the step that caused them ends, as vLLM publishes them after its
step; the gateway sees them a little later still (its lag is not modelled).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from marsproxy.emulator import kv_cache
from marsproxy.emulator.engine import Engine
from marsproxy.probes import kv_wire
from marsproxy.probes.kv_index import MEDIUM_GPU, KVIndex


def wire_events(events: Sequence[kv_cache.KVEvent], block_size: int) -> tuple[kv_wire.KVEvent, ...]:
    """The engine's events as the index reads them off the wire."""
    out: list[kv_wire.KVEvent] = []
    for ev in events:
        if isinstance(ev, kv_cache.BlockStored):
            out.append(kv_wire.BlockStored(
                tuple(ev.block_hashes), ev.parent, tuple(ev.token_ids), block_size, MEDIUM_GPU,
                session_id=ev.session_id))
        else:
            out.append(kv_wire.BlockRemoved((ev.block_hash,), MEDIUM_GPU))
    return tuple(out)


class KVView:
    """One KV index per emulated worker, fed at the end of each engine step."""

    def __init__(self, engines: Mapping[str, Engine]) -> None:
        self.engines = engines  # filled by the simulation after this is made
        self.indexes: dict[str, KVIndex] = {}
        self._seq: dict[str, int] = {}

    def _start(self) -> None:
        """Engines record events from the first request on (before it, they did nothing)."""
        if self.indexes:
            return
        for w, eng in self.engines.items():
            eng.kv.record_events()
            ix = KVIndex(replay=False, max_pending=1)
            ix.begin()
            self.indexes[w] = ix
            self._seq[w] = 0

    def step_done(self, worker: str, now: float) -> None:
        """A step of ``worker``'s engine ended: its events reach the index."""
        ix = self.indexes.get(worker)
        if ix is None:
            return
        eng = self.engines[worker]
        events = eng.kv.take_events()
        if not events:
            return
        batch = kv_wire.EventBatch(now, wire_events(events, eng.kv.block_size))
        ix.on_batch(self._seq[worker], batch, now)
        self._seq[worker] += 1

    def prefix(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Leading tokens of a prompt resident per worker (``KVUse.prefix``)."""
        self._start()
        return {w: ix.resident_prefix_tokens(token_ids) for w, ix in self.indexes.items()}

    def resident(self, worker: str, token_ids: Sequence[int]) -> int:
        """Leading tokens of a call's prompt resident on its worker (``KVUse.resident``)."""
        self._start()
        return self.indexes[worker].resident_prefix_tokens(token_ids)

    def session_blocks(self, worker: str) -> dict[str, int]:
        """Resident blocks per session on ``worker`` (``KVUse.session_blocks``)."""
        self._start()
        return self.indexes[worker].session_block_counts()
