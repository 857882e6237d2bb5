"""What one worker holds in its KV cache, rebuilt from its KV events (sans-IO).

:class:`KVIndex` applies vLLM's event batches (:mod:`marsproxy.probes.kv_wire`) in sequence
order and answers two questions: how many leading tokens of a prompt are resident (what the
engine would serve from its prefix cache), and how many blocks a session's requests stored.

Blocks are matched by *content*, not by vLLM's block hash: the hash algorithm and its seed may
differ between processes, so the index chains its own key over each block's token ids
(``key = hash((parent_key, block_tokens))``; Python's hash of a tuple of ints is the same in
every process) and keeps only those keys and vLLM's hashes, never text. A block whose parent is
unknown (history missed) or whose hash covers more than its tokens (cache salt, LoRA,
multimodal input) is counted as resident but never matches a prompt.

Sequencing: batches carry consecutive numbers. A batch ahead of the next expected one is held
back and the caller is asked to replay from the missing number; replayed batches fill the gap
and the held ones follow. A gap the replay cannot fill (the publisher's buffer no longer holds
it, no replay socket, too many batches or bytes held) resynchronises: the index forgets all and
goes on from the oldest held batch (it under-counts rather than believes in blocks that may be
gone). A live batch numbered below the expected one means the worker restarted: the index is
reset and replays the new process's history from 0. A replay that a later one superseded feeds
nothing; one sending over ``max_pending`` batches past the held one it must reach is cut off.

Bounds: an engine whose removals never arrive (a publisher that drops them, a report mode
that re-stores blocks) must not grow the index without bound. A medium holds at most
``engine_blocks`` (the worker's ``num_gpu_blocks``, for GPU, when the caller knows it) or
``max_blocks``; beyond that the oldest stored block is dropped (``dropped_blocks_total``): the
engine cannot hold more, so some of them are gone, and the oldest are the likeliest. At most
``MAX_MEDIA`` media are kept. Events the decoder could not read are counted
(``bad_events_total``); one that may have removed blocks makes the index forget them all.

Pure code: the caller passes the wall clock (seconds) it read at each step.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from marsproxy.probes.kv_wire import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Unreadable,
)

MEDIUM_GPU = "GPU"  # vLLM's medium for its own block pool; also used when an event names none
_ROOT = 0  # the parent key of a prompt's first block
_UNMATCHABLE = -1  # parent key marker of blocks that must never match a prompt
MAX_BLOCKS = 1_000_000  # per medium, where the engine's size is unknown (~300 MB of index)
MAX_MEDIA = 4  # vLLM names GPU and CPU; offloading connectors may add one or two


def chain_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The content keys of the full blocks of ``token_ids``, first block first."""
    keys: list[int] = []
    parent = _ROOT
    for i in range(len(token_ids) // block_size):
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        keys.append(parent)
    return keys


def prediction_outcome(predicted: int, actual: int, block_size: int) -> str:
    """How a prediction of ``cached_tokens`` compares with what the engine reported:
    ``exact``, ``within_block`` (off by at most one block) or ``off``."""
    if predicted == actual:
        return "exact"
    return "within_block" if abs(predicted - actual) <= block_size else "off"


@dataclass(frozen=True, slots=True)
class Step:
    """What the caller must do after feeding the index: ask for a replay from ``replay_from``
    (None: none) and feed it as ``replay_id``; ``reset``: the index forgot its blocks."""

    replay_from: int | None = None
    reset: bool = False
    replay_id: int = 0


class _Block:
    __slots__ = ("holders", "key", "session")

    def __init__(self, key: int | None, session: str | None) -> None:
        self.key = key  # content key; None: cannot match a prompt
        self.session = session
        # Blocks holding this hash: two requests that computed the same prefix at once each
        # store it, and each of their blocks is removed on its own.
        self.holders = 1


class KVIndex:
    """One worker's resident blocks, per medium and per session, from its event stream."""

    def __init__(self, *, replay: bool, max_pending: int, rate_window_s: float = 10.0,
                 max_blocks: int = MAX_BLOCKS, max_pending_bytes: int | None = None) -> None:
        self.max_pending_bytes = math.inf if max_pending_bytes is None else max_pending_bytes
        if min(max_pending, max_blocks, self.max_pending_bytes) < 1 or rate_window_s <= 0:
            raise ValueError("max_pending, max_pending_bytes, max_blocks: >= 1; rate_window_s > 0")
        self.replay = replay
        self.max_pending = max_pending
        self.rate_window_s = rate_window_s
        self.max_blocks = max_blocks
        self.engine_blocks: int | None = None  # GPU blocks the worker has (its num_gpu_blocks)
        self.block_size: int | None = None
        self._blocks: dict[str, dict[BlockHash, _Block]] = {}
        self._resident: dict[str, Counter[int]] = {}  # medium -> content key -> holders
        self._sessions: dict[str, Counter[str]] = {}  # medium -> session -> blocks
        self.expected: int | None = None  # next sequence number; None: take what comes
        self._pending: dict[int, tuple[EventBatch, int]] = {}  # seq -> (batch, payload bytes)
        self._pending_bytes = 0
        self.replaying = False  # waiting for the replay ``replay_id``
        self.replay_id = 0  # the latest replay asked for
        self._replay_start, self._replay_batches = 0, 0  # where it began, batches it sent
        self._replay_target: int | None = None  # batches from its start to the held one
        self.synced = False  # the history since the last (re)start is replayed (or needs none)
        # counters
        self.events_total = 0
        self.batches_total = 0
        self.resyncs_total = 0
        self.duplicates_total = 0
        self.unknown_removals_total = 0
        self.dropped_blocks_total = 0  # blocks let go beyond what the engine can hold
        self.bad_events_total = 0  # events the decoder could not read
        self.stale_replay_batches_total = 0  # batches of a replay no longer waited for
        self.replays_cut_total = 0  # replays given up for sending too many batches
        self.pending_overflows_total = 0  # resyncs for too many batches or bytes held
        self.last_seq: int | None = None
        self.last_lag_s: float | None = None
        self._rate: deque[tuple[float, int]] = deque()

    # -- sequencing -----------------------------------------------------------------------------

    def begin(self) -> Step:
        """A (re)connection to the publisher: forget what was known (a worker may have restarted
        behind it) and, with a replay socket, fetch its history from 0."""
        self._clear()
        self._pending, self._pending_bytes = {}, 0
        self.synced = False
        if not self.replay:
            self.expected, self.replaying, self.synced = None, False, True
            return Step(reset=True)
        self.expected = 0
        return self._ask(0, reset=True)

    def awaits(self, replay_id: int) -> bool:
        """Whether the index still waits for the replay ``replay_id`` (else: stop reading it)."""
        return self.replaying and replay_id == self.replay_id

    def on_batch(self, seq: int, batch: EventBatch, now: float, *, replay: int | None = None,
                 size: int = 0) -> Step:
        """Feed one batch (live, or of the replay ``replay``) of ``size`` payload bytes."""
        if replay is not None:
            if not self.awaits(replay):
                self.stale_replay_batches_total += 1
                return Step()
            self._replay_batches += 1
            if self._replay_batches > self.max_pending + (self._replay_target or 0):
                self.replays_cut_total += 1  # given up as if it had ended: a gap left resyncs
                return self.replay_done(now, replay)
        if self.expected is None:
            self.expected = seq
        if seq == self.expected:
            self._apply(seq, batch, now)
            self._drain(now)
            return Step()
        if seq < self.expected:
            if replay is not None:
                self.duplicates_total += 1
                return Step()
            return self._restarted(seq, batch, now, size)
        # A gap: hold this batch until the missing ones come.
        self._hold(seq, batch, size, live=replay is None)
        if not self.replay:
            return self._resync(now)
        if (len(self._pending) > self.max_pending
                or self._pending_bytes > self.max_pending_bytes):
            self.pending_overflows_total += 1
            return self._resync(now)
        if self.replaying:
            return Step()
        return self._ask(self.expected, target=seq - self.expected)

    def replay_done(self, now: float, replay_id: int) -> Step:
        """The replay ``replay_id`` ended (its end marker, or it timed out): a gap still open
        is lost. The end of a replay no longer waited for changes nothing."""
        if not self.awaits(replay_id):
            return Step()
        self.replaying, self.synced = False, True
        if self._pending and self.expected not in self._pending:
            return self._resync(now)
        return Step()

    def _ask(self, start: int, *, reset: bool = False, target: int | None = None) -> Step:
        self.replaying = True
        self.replay_id += 1
        self._replay_start, self._replay_target, self._replay_batches = start, target, 0
        return Step(replay_from=start, reset=reset, replay_id=self.replay_id)

    def _hold(self, seq: int, batch: EventBatch, size: int, *, live: bool) -> None:
        self._pending_bytes += size - self._pending.get(seq, (batch, 0))[1]
        self._pending[seq] = (batch, size)
        if live and self.replaying and self._replay_target is None:
            self._replay_target = seq - self._replay_start  # (one at a connection learns it here)

    def _restarted(self, seq: int, batch: EventBatch, now: float, size: int) -> Step:
        self.resyncs_total += 1
        step = self.begin()
        if not self.replay or seq == 0:
            self.expected, self.replaying, self.synced = seq, False, True
            self._apply(seq, batch, now)
            return Step(reset=True)
        self._hold(seq, batch, size, live=True)
        return step

    def _resync(self, now: float) -> Step:
        self.resyncs_total += 1
        self._clear()
        self.expected = min(self._pending)
        self._drain(now)
        return Step(reset=True)

    def _drain(self, now: float) -> None:
        while self.expected in self._pending:
            seq = self.expected
            batch, size = self._pending.pop(seq)
            self._pending_bytes -= size
            self._apply(seq, batch, now)

    # -- applying -------------------------------------------------------------------------------

    def _apply(self, seq: int, batch: EventBatch, now: float) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev)
            elif isinstance(ev, AllBlocksCleared):
                self._clear()
            elif isinstance(ev, Unreadable):
                self.bad_events_total += 1
                if ev.removes:
                    self.resyncs_total += 1
                    self._clear()
        self.expected = seq + 1
        self.last_seq = seq
        self.batches_total += 1
        self.events_total += len(batch.events)
        lag = now - batch.ts
        self.last_lag_s = max(0.0, lag) if math.isfinite(lag) else None
        self._rate.append((now, len(batch.events)))
        self._trim_rate(now)

    def _parent_key(self, ev: BlockStored) -> int | None:
        if ev.parent_block_hash is None:
            return _ROOT
        medium = ev.medium or MEDIUM_GPU
        blocks = self._blocks.get(medium, {})
        found = blocks.get(ev.parent_block_hash)
        if found is None:  # maybe held in another medium
            for other in self._blocks.values():
                found = other.get(ev.parent_block_hash)
                if found is not None:
                    break
        return None if found is None else found.key

    def _stored(self, ev: BlockStored) -> None:
        medium = ev.medium or MEDIUM_GPU
        n, bs = len(ev.block_hashes), ev.block_size
        if medium not in self._blocks and len(self._blocks) >= MAX_MEDIA:
            self.dropped_blocks_total += n
            return
        parent = _UNMATCHABLE if ev.salted else self._parent_key(ev)
        keys: list[int | None]
        if parent is None or parent == _UNMATCHABLE or not n or len(ev.token_ids) != n * bs:
            keys = [None] * n  # (no block: nothing said of their size either)
        else:
            self.block_size = bs
            keys = []
            for i in range(n):
                parent = hash((parent, ev.token_ids[i * bs : (i + 1) * bs]))
                keys.append(parent)
        blocks = self._blocks.get(medium)
        if blocks is None:
            blocks = self._blocks[medium] = {}
            self._resident[medium], self._sessions[medium] = Counter(), Counter()
        resident, sessions = self._resident[medium], self._sessions[medium]
        for h, key in zip(ev.block_hashes, keys, strict=True):
            old = blocks.get(h)
            if old is not None:  # another holder; the latest session owns it
                old.holders += 1
                if ev.session_id is not None and ev.session_id != old.session:
                    self._count_session(sessions, old.session, -1)
                    old.session = ev.session_id
                    self._count_session(sessions, old.session, 1)
                continue
            blocks[h] = _Block(key, ev.session_id)
            if key is not None:
                resident[key] += 1
            self._count_session(sessions, ev.session_id, 1)
        limit = self.max_blocks
        if medium == MEDIUM_GPU and self.engine_blocks:
            limit = min(limit, self.engine_blocks)
        while len(blocks) > limit:  # removals were lost: let the oldest go
            self._forget(medium, next(iter(blocks)))
            self.dropped_blocks_total += 1

    def _removed(self, ev: BlockRemoved) -> None:
        medium = ev.medium or MEDIUM_GPU
        blocks = self._blocks.get(medium, {})
        for h in ev.block_hashes:
            gone = blocks.get(h)
            if gone is None:
                self.unknown_removals_total += 1
                continue
            gone.holders -= 1
            if gone.holders <= 0:
                self._forget(medium, h)

    def _forget(self, medium: str, h: BlockHash) -> None:
        gone = self._blocks[medium].pop(h)
        resident = self._resident[medium]
        if gone.key is not None:
            resident[gone.key] -= 1
            if resident[gone.key] <= 0:
                del resident[gone.key]
        self._count_session(self._sessions[medium], gone.session, -1)

    @staticmethod
    def _count_session(sessions: Counter[str], session: str | None, delta: int) -> None:
        if session is None:
            return
        sessions[session] += delta
        if sessions[session] <= 0:
            del sessions[session]

    def _clear(self) -> None:
        self._blocks.clear()
        self._resident.clear()
        self._sessions.clear()

    def _trim_rate(self, now: float) -> None:
        while self._rate and self._rate[0][0] < now - self.rate_window_s:
            self._rate.popleft()

    # -- queries --------------------------------------------------------------------------------

    def resident_prefix_tokens(self, token_ids: Sequence[int], medium: str = MEDIUM_GPU) -> int:
        """Leading tokens of ``token_ids`` whose blocks are resident in ``medium`` (whole blocks;
        0 before the block size is known)."""
        bs = self.block_size
        resident = self._resident.get(medium)
        if bs is None or not resident:
            return 0
        parent, n = _ROOT, 0
        for i in range(len(token_ids) // bs):
            parent = hash((parent, tuple(token_ids[i * bs : (i + 1) * bs])))
            if parent not in resident:
                break
            n += 1
        return n * bs

    def predicted_cached_tokens(self, token_ids: Sequence[int], medium: str = MEDIUM_GPU) -> int:
        """What the engine would report as ``cached_tokens`` for this prompt now: the resident
        prefix, less the last prompt token (always computed), in whole blocks."""
        bs = self.block_size
        if bs is None or not token_ids:
            return 0
        cap = (len(token_ids) - 1) // bs * bs
        return min(self.resident_prefix_tokens(token_ids, medium), cap)

    def session_blocks(self, session: str, medium: str = MEDIUM_GPU) -> int:
        """Resident blocks in ``medium`` last stored or reported by ``session``'s requests."""
        return self._sessions.get(medium, Counter()).get(session, 0)

    def session_block_counts(self, medium: str = MEDIUM_GPU) -> dict[str, int]:
        """Resident blocks in ``medium`` per session (sessions with none are absent)."""
        return dict(self._sessions.get(medium, {}))

    def blocks(self, medium: str = MEDIUM_GPU) -> int:
        return len(self._blocks.get(medium, {}))

    def blocks_by_medium(self) -> dict[str, int]:
        return {m: len(b) for m, b in self._blocks.items()}

    def sessions(self, medium: str = MEDIUM_GPU) -> int:
        return len(self._sessions.get(medium, {}))

    def events_per_s(self, now: float) -> float:
        self._trim_rate(now)
        return sum(n for _, n in self._rate) / self.rate_window_s

    @property
    def pending(self) -> int:
        return len(self._pending)
