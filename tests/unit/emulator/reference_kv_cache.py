"""Test oracle, KV part: the prefix cache as first written (straightforward, O(context)).

A frozen copy of marsproxy/emulator/kv_cache.py before the performance work: every lookup walks
the prompt's hash chain from its start, every prompt block is hashed with a slice per block, and
block state lives in objects. reference_engine.py schedules over it, and
tests/unit/emulator/test_emulator_fast_path.py requires both to give the package's results. Do
not optimise this file; it is the specification the fast path is checked against.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


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


@dataclass
class _Block:
    ref_cnt: int = 0
    block_hash: int | None = None


@dataclass
class KVCache:
    block_size: int
    num_blocks: int
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self._blocks = [_Block() for _ in range(self.num_blocks)]
        # Insertion order = LRU order; evict from the front, release to the back.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id

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
        for i in range(len(seq.block_hashes), len(token_ids) // bs):
            parent = seq.block_hashes[i - 1] if i else 0
            seq.block_hashes.append(hash((parent, tuple(token_ids[i * bs : (i + 1) * bs]))))

    # -- prefix lookup ---------------------------------------------------------------------
    def find_prefix(self, seq: KVSeq, num_tokens: int) -> list[int]:
        """Cached blocks matching the start of ``seq``'s hash chain, capped so that at least one
        token is left to compute."""
        limit = (num_tokens - 1) // self.block_size
        hit: list[int] = []
        for h in seq.block_hashes[:limit]:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    # -- allocation ------------------------------------------------------------------------
    def can_allocate(self, seq: KVSeq, total_tokens: int, hit: Sequence[int] = ()) -> bool:
        need = self.blocks_for(total_tokens) - len(seq.blocks) - len(hit)
        # Hit blocks that are free now get taken out of the free queue, not evicted.
        evictable_hits = sum(1 for b in hit if self._blocks[b].ref_cnt == 0)
        return need <= len(self._free) - evictable_hits

    def allocate(self, seq: KVSeq, total_tokens: int, hit: Sequence[int] = ()) -> bool:
        """Give ``seq`` blocks for ``total_tokens`` tokens, reusing the ``hit`` prefix blocks first.
        Returns False (and changes nothing) when there are not enough free blocks."""
        if not self.can_allocate(seq, total_tokens, hit):
            return False
        for b in hit:
            blk = self._blocks[b]
            if blk.ref_cnt == 0:
                del self._free[b]
            blk.ref_cnt += 1
            seq.blocks.append(b)
        seq.num_cached_blocks = len(seq.blocks) if hit else seq.num_cached_blocks
        for _ in range(self.blocks_for(total_tokens) - len(seq.blocks)):
            b, _unused = self._free.popitem(last=False)
            blk = self._blocks[b]
            if blk.block_hash is not None:  # evict the least recently used cached block
                if self._cached.get(blk.block_hash) == b:
                    del self._cached[blk.block_hash]
                blk.block_hash = None
            blk.ref_cnt = 1
            seq.blocks.append(b)
        return True

    def cache_full_blocks(self, seq: KVSeq, num_computed_tokens: int) -> None:
        """Register ``seq``'s blocks whose tokens are all computed so later prompts can hit them."""
        upto = min(num_computed_tokens // self.block_size, len(seq.block_hashes), len(seq.blocks))
        for i in range(seq.num_cached_blocks, upto):
            h = seq.block_hashes[i]
            blk = self._blocks[seq.blocks[i]]
            if blk.block_hash is None:
                blk.block_hash = h
                # Keep the first holder of a hash, like vLLM (duplicates just are not findable).
                self._cached.setdefault(h, seq.blocks[i])
        seq.num_cached_blocks = max(seq.num_cached_blocks, upto)

    def free(self, seq: KVSeq) -> None:
        """Drop ``seq``'s references. Tail blocks go to the free queue first, so they are evicted
        before the shared prefix blocks (as vLLM frees in reverse order)."""
        for b in reversed(seq.blocks):
            blk = self._blocks[b]
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self._free[b] = None
        seq.reset()
