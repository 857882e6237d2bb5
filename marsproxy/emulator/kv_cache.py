"""Paged KV cache with automatic prefix caching, after vLLM V1's BlockPool/KVCacheManager.

- A block holds ``block_size`` tokens. A FULL block gets a hash chained from its parent's hash and
  its token ids, and is then findable by later requests with the same prefix.
- Blocks with ref count 0 sit in a free queue ordered least-recently-used first. They keep their
  hash (stay cached) until a new allocation takes them, which evicts them.
- A prompt hit is capped at ``num_tokens - 1`` tokens rounded down to blocks: the last prompt
  token must be computed to produce logits (vLLM's ``max_cache_hit_length``).

Speed (the simulator steps this model millions of times at 64k–128k-token contexts): block state
lives in two flat lists rather than per-block objects, per-block work over a whole prompt runs in
C where it can (``map``/``zip``/``deque`` instead of Python loops), the hit of the request at the
head of the waiting queue is remembered across steps with its count of free blocks
(:class:`_HitMemo`), so a prompt that cannot be admitted yet costs O(1) per step, and the next
turn of a conversation reuses the finished turn's hash chain (:meth:`KVCache.hash_prompt`). None
of this changes a result; the straightforward model is kept as a test oracle
(tests/unit/emulator/reference_kv_cache.py) and docs/emulator.md has the numbers.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat
from typing import cast

# Chains of finished requests are kept so the next turn of the same conversation (its prompt
# extends the finished one's tokens) hashes only its new blocks. Looked up by the hash of the
# first _CHAIN_KEY_BLOCKS blocks; at most _CHAINS_PER_KEY per key and _CHAIN_TOKENS_PER_KV_TOKEN
# token ids per KV-cache token in all (a memory bound: ~45 MB for the H200 profile; a miss only
# costs hashing).
_CHAIN_KEY_BLOCKS = 64
_CHAINS_PER_KEY = 4
_CHAIN_TOKENS_PER_KV_TOKEN = 8


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became findable (chained hashes; parent None at a prompt's start)."""

    block_hashes: list[int]
    parent: int | None
    token_ids: list[int]
    session_id: str | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A block's hash dropped from the cache (the block was taken for new tokens)."""
    block_hash: int


KVEvent = BlockStored | BlockRemoved


class KVSeq:
    """Per-request KV state: its blocks and the hash chain of its full blocks."""

    __slots__ = ("block_hashes", "blocks", "num_cached_blocks")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.block_hashes: list[int] = []
        self.num_cached_blocks = 0  # leading blocks already registered in the cache map

    def reset(self) -> None:
        self.blocks.clear()
        self.num_cached_blocks = 0


@dataclass
class PrefixCacheStats:
    """Token counts, as vLLM's ``vllm:prefix_cache_queries``/``hits`` counters."""

    queries: int = 0
    hits: int = 0


class _HitMemo:
    """The cached blocks matching the start of one sequence's hash chain, kept up to date.

    Valid as long as every block in ``hit`` still holds its hash in the cache map; an eviction
    of one of them cuts ``hit`` there. New cache entries never invalidate it: a lookup resumes at
    the end of ``hit``, where the chain first missed.
    """

    __slots__ = ("free_hits", "hit", "pos", "ref", "seq")

    def __init__(self, seq: KVSeq, ref: list[int]) -> None:
        self.seq = seq
        self.ref = ref  # the cache's ref counts
        self.hit: list[int] = []
        self.pos: dict[int, int] = {}  # block id -> its first index in ``hit``
        # Entries of ``hit`` whose block is free (ref count 0), kept current by the cache, so
        # an admission check need not count them again every step (see ``evictable``).
        self.free_hits = 0

    def _count_free(self, blocks: list[int]) -> int:
        return list(map(self.ref.__getitem__, blocks)).count(0)

    def extend(self, blocks: list[int]) -> None:
        start = len(self.hit)
        self.hit.extend(blocks)
        self.free_hits += self._count_free(blocks)
        # Built in C; reversed so that a block listed twice keeps its first index (and one
        # already listed keeps its earlier index). Twice only happens on a hash collision.
        end = start + len(blocks)
        new = dict(zip(reversed(blocks), range(end - 1, start - 1, -1), strict=True))
        if not self.pos.keys().isdisjoint(new):
            for b in self.pos.keys() & new.keys():
                del new[b]
        self.pos.update(new)

    def cut(self, i: int) -> None:
        """Forget ``hit[i:]``."""
        pos = self.pos
        listed_twice = len(pos) != len(self.hit)  # then ref_changed may have miscounted
        for b in self.hit[i:]:
            if pos.get(b, -1) >= i:
                del pos[b]
        self.free_hits -= self._count_free(self.hit[i:])
        del self.hit[i:]
        if listed_twice:
            self.free_hits = self._count_free(self.hit)

    def ref_changed(self, blocks: Iterable[int], delta: int) -> None:
        """``blocks`` (distinct) just became free (delta 1) or taken (delta -1)."""
        pos = self.pos
        if not pos.keys().isdisjoint(blocks):
            self.free_hits += delta * len(pos.keys() & set(blocks))

    def evictable(self, seq: KVSeq, hit: Sequence[int]) -> int | None:
        """``free_hits`` if ``hit`` is this memo's hit of ``seq`` and no block is listed twice;
        None when the caller must count."""
        if seq is self.seq and len(self.pos) == len(self.hit) and hit == self.hit:
            return self.free_hits
        return None


@dataclass
class KVCache:
    block_size: int
    num_blocks: int
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self._ref = [0] * self.num_blocks  # block id -> number of sequences holding it
        self._hash: list[int | None] = [None] * self.num_blocks  # block id -> hash, if cached
        # Insertion order = LRU order; evict from the front, release to the back.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._memo = _HitMemo(KVSeq(), self._ref)  # remembers nothing until the first lookup
        # key -> (token ids, their chain), most recent last; LRU over keys for the memory bound.
        self._chains: OrderedDict[int, list[tuple[list[int], list[int]]]] = OrderedDict()
        self._chain_tokens = 0
        # KV events (vLLM's --kv-events-config), recorded only when a publisher asked for them
        # (:meth:`record_events`); taken once per step by :meth:`take_events`.
        self._events: list[KVEvent] | None = None

    # -- KV events -----------------------------------------------------------------------
    def record_events(self) -> None:
        """Record stored/removed events from now on (off by default: the simulator pays 0)."""
        if self._events is None:
            self._events = []

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any request (including free blocks that are still cached)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: referenced blocks over all blocks (cached-free excluded)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def free_queue_order(self) -> list[int]:
        """Free block ids, next-to-evict first (for tests and debugging)."""
        return list(self._free)

    # -- hashing ---------------------------------------------------------------------------
    def extend_hashes(self, seq: KVSeq, token_ids: Sequence[int]) -> None:
        """Hash every full block of ``token_ids`` not hashed yet (token ids only ever grow)."""
        bs = self.block_size
        hashes = seq.block_hashes
        start, end = len(hashes), len(token_ids) // bs
        if start >= end:
            return
        parent = hashes[-1] if hashes else 0
        append = hashes.append
        # zip over one iterator cuts the tokens into block tuples in C.
        for block in zip(*[iter(token_ids[start * bs : end * bs])] * bs, strict=True):
            parent = hash((parent, block))
            append(parent)

    def hash_prompt(self, seq: KVSeq, token_ids: list[int]) -> None:
        """``extend_hashes`` for a new prompt, reusing the chain of a finished request whose
        tokens the prompt starts with (checked token by token, so the chain is the same)."""
        key_len = _CHAIN_KEY_BLOCKS * self.block_size
        self.extend_hashes(seq, token_ids[:key_len])
        if len(seq.block_hashes) == _CHAIN_KEY_BLOCKS and len(seq.block_hashes) < len(
            token_ids
        ) // self.block_size:
            entries = self._chains.get(seq.block_hashes[-1], [])
            for k in range(len(entries) - 1, -1, -1):
                tokens, hashes = entries[k]
                n = min(len(tokens), len(token_ids)) // self.block_size * self.block_size
                if n > key_len and token_ids[key_len:n] == tokens[key_len:n]:
                    seq.block_hashes.extend(hashes[_CHAIN_KEY_BLOCKS : n // self.block_size])
                    break
        self.extend_hashes(seq, token_ids)

    def remember_chain(self, token_ids: list[int], seq: KVSeq) -> None:
        """Keep a finished request's tokens and chain for :meth:`hash_prompt`."""
        if len(seq.block_hashes) <= _CHAIN_KEY_BLOCKS:
            return
        key = seq.block_hashes[_CHAIN_KEY_BLOCKS - 1]
        entries = self._chains.setdefault(key, [])
        self._chains.move_to_end(key)
        # An earlier turn of this conversation is a prefix of this one: this one replaces it.
        kept = [e for e in entries if e[0] != token_ids[: len(e[0])]]
        kept.append((token_ids, seq.block_hashes))
        del kept[:-_CHAINS_PER_KEY]
        self._chain_tokens += sum(len(t) for t, _ in kept) - sum(len(t) for t, _ in entries)
        entries[:] = kept
        cap = _CHAIN_TOKENS_PER_KV_TOKEN * self.num_blocks * self.block_size
        while self._chain_tokens > cap:
            _, old = self._chains.popitem(last=False)
            self._chain_tokens -= sum(len(t) for t, _ in old)

    # -- prefix lookup ---------------------------------------------------------------------
    def find_prefix(self, seq: KVSeq, num_tokens: int) -> list[int]:
        """Cached blocks matching the start of ``seq``'s hash chain, capped so that at least one
        token is left to compute."""
        limit = (num_tokens - 1) // self.block_size
        memo = self._memo
        if memo.seq is not seq:
            memo = self._memo = _HitMemo(seq, self._ref)
        hit = memo.hit
        if len(hit) > limit:  # asked with a shorter prompt than last time
            memo.cut(limit)
        # Usually the chain still misses where it missed last step: one lookup, no walk. Else
        # walk on in C, in growing chunks, so a chain that breaks soon is not looked up whole.
        get, hashes, chunk = self._cached.get, seq.block_hashes, 16
        while len(hit) < limit and hashes[len(hit)] in self._cached:
            start = len(hit)
            found = list(map(get, hashes[start : min(limit, start + chunk)]))
            if None in found:  # the chain breaks here
                del found[found.index(None) :]
                memo.extend(cast(list[int], found))
                break
            memo.extend(cast(list[int], found))
            chunk *= 4
        return hit[:]

    # -- allocation ------------------------------------------------------------------------
    def can_allocate(self, seq: KVSeq, total_tokens: int, hit: Sequence[int] = ()) -> bool:
        need = self.blocks_for(total_tokens) - len(seq.blocks) - len(hit)
        free = len(self._free)
        if need > free:
            return False
        if need + len(hit) <= free:
            return True
        evictable = self._memo.evictable(seq, hit)
        if evictable is None:
            evictable = list(map(self._ref.__getitem__, hit)).count(0)
        return need <= free - evictable

    def allocate(self, seq: KVSeq, total_tokens: int, hit: Sequence[int] = ()) -> bool:
        """Give ``seq`` blocks for ``total_tokens`` tokens, reusing the ``hit`` prefix blocks first.
        Returns False (and changes nothing) when there are not enough free blocks."""
        if not self.can_allocate(seq, total_tokens, hit):
            return False
        ref, free, blocks = self._ref, self._free, seq.blocks
        if hit:
            reused = []
            for b in hit:
                if ref[b] == 0:
                    del free[b]
                    reused.append(b)
                ref[b] += 1
            self._memo.ref_changed(reused, -1)
            blocks.extend(hit)
            seq.num_cached_blocks = len(blocks)
        n_new = self.blocks_for(total_tokens) - len(blocks)
        if n_new <= 0:
            return True
        taken = list(islice(free, n_new))  # the least recently used free blocks
        _consume(map(free.__delitem__, taken))
        hashes = self._hash
        old = list(map(hashes.__getitem__, taken))
        if old.count(None) != n_new:
            evicted = [(h, b) for h, b in zip(old, taken, strict=True) if h is not None]
            self._evict(evicted)
            if self._events is not None:  # one event per evicted block, as vLLM
                self._events.extend(BlockRemoved(h) for h, _ in evicted)
            _consume(map(hashes.__setitem__, taken, repeat(None)))
        _consume(map(ref.__setitem__, taken, repeat(1)))
        blocks.extend(taken)
        return True

    def _evict(self, entries: list[tuple[int, int]]) -> None:
        """Drop cached ``(hash, block)`` entries of blocks being reused (a block that was only a
        duplicate holder of its hash was never findable)."""
        cached = self._cached
        owners = map(cached.get, [h for h, _ in entries])
        gone = [(h, b) for (h, b), owner in zip(entries, owners, strict=True) if owner == b]
        _consume(map(cached.__delitem__, [h for h, _ in gone]))
        pos = self._memo.pos
        if not pos.keys().isdisjoint(b for _, b in gone):
            self._memo.cut(min(pos[b] for _, b in gone if b in pos))

    def cache_full_blocks(
        self, seq: KVSeq, num_computed_tokens: int, token_ids: Sequence[int] = (),
        session_id: str | None = None,
    ) -> None:
        """Register ``seq``'s blocks whose tokens are all computed so later prompts can hit them.
        ``token_ids`` (the request's tokens) and ``session_id`` only go into the KV events."""
        upto = min(num_computed_tokens // self.block_size, len(seq.block_hashes), len(seq.blocks))
        start = seq.num_cached_blocks
        if upto <= start:
            return
        if self._events is not None:
            self._stored_event(seq, start, upto, token_ids, session_id)
        hashes, setdefault = self._hash, self._cached.setdefault
        new_blocks, new_hashes = seq.blocks[start:upto], seq.block_hashes[start:upto]
        # Keep the first holder of a hash, like vLLM (duplicates just are not findable).
        if list(map(hashes.__getitem__, new_blocks)).count(None) == len(new_blocks) and len(
            set(new_blocks)
        ) == len(new_blocks):  # the usual case, in C: fresh blocks, none listed twice
            _consume(map(hashes.__setitem__, new_blocks, new_hashes))
            _consume(map(setdefault, new_hashes, new_blocks))
        else:
            for b, h in zip(new_blocks, new_hashes, strict=True):
                if hashes[b] is None:
                    hashes[b] = h
                    setdefault(h, b)
        seq.num_cached_blocks = upto

    def _stored_event(
        self, seq: KVSeq, start: int, upto: int, token_ids: Sequence[int], session_id: str | None
    ) -> None:
        """BlockStored for blocks ``start:upto`` of ``seq`` that get a hash now (duplicates of
        a cached hash included, as vLLM reports them); one event per contiguous run."""
        assert self._events is not None
        hashes, bs, chain = self._hash, self.block_size, seq.block_hashes
        run: list[int] = []
        for i in [*(i for i in range(start, upto) if hashes[seq.blocks[i]] is None), -1]:
            if run and (i != run[-1] + 1):
                a, b = run[0], run[-1] + 1
                self._events.append(BlockStored(chain[a:b], chain[a - 1] if a else None,
                                                list(token_ids[a * bs : b * bs]), session_id))
                run = []
            run.append(i)

    def free(self, seq: KVSeq) -> None:
        """Drop ``seq``'s references. Tail blocks go to the free queue first, so they are evicted
        before the shared prefix blocks (as vLLM frees in reverse order)."""
        ref, free, blocks = self._ref, self._free, seq.blocks
        if len(set(blocks)) == len(blocks):  # the usual case, mostly in C: no block listed twice
            refs = [r - 1 for r in map(ref.__getitem__, blocks)]
            _consume(map(ref.__setitem__, blocks, refs))
            released = [b for b, r in zip(reversed(blocks), reversed(refs), strict=True) if not r]
            _consume(map(free.__setitem__, released, repeat(None)))
        else:
            released = []
            for b in reversed(blocks):
                r = ref[b] - 1
                ref[b] = r
                if r == 0:
                    free[b] = None
                    released.append(b)
        self._memo.ref_changed(released, 1)
        seq.reset()


def _consume(it: Iterable[object]) -> None:
    """Run an iterator of side effects (``map`` over a setter) to the end, in C."""
    deque(it, maxlen=0)
