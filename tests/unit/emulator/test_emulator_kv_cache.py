"""Paged KV cache: hash chains, the max-hit rule, LRU eviction of free cached blocks, usage."""

from __future__ import annotations

from marsproxy.emulator.kv_cache import KVCache, KVSeq


def _seq(kv: KVCache, tokens: list[int]) -> KVSeq:
    seq = KVSeq()
    kv.extend_hashes(seq, tokens)
    return seq


def _run(kv: KVCache, tokens: list[int]) -> KVSeq:
    """Allocate, compute and cache all of ``tokens``; returns the still-referenced sequence."""
    seq = _seq(kv, tokens)
    assert kv.allocate(seq, len(tokens), kv.find_prefix(seq, len(tokens)))
    kv.cache_full_blocks(seq, len(tokens))
    return seq


def test_full_hit_recomputes_last_block() -> None:
    kv = KVCache(block_size=16, num_blocks=8)
    tokens = list(range(32))
    kv.free(_run(kv, tokens))
    again = _seq(kv, tokens)
    # 32 tokens are cached, but at most num_tokens - 1 = 31 may hit -> one full block.
    assert len(kv.find_prefix(again, 32)) == 1
    assert len(kv.find_prefix(_seq(kv, [*tokens, 99]), 33)) == 2
    # A different first block breaks the chain even if the second block's tokens match.
    assert kv.find_prefix(_seq(kv, [7, *tokens[1:], 99]), 33) == []


def test_partial_blocks_are_not_cached() -> None:
    kv = KVCache(block_size=4, num_blocks=8)
    seq = _run(kv, list(range(6)))
    assert kv.is_cached(seq.block_hashes[0])
    assert len(seq.block_hashes) == 1  # the 2-token tail has no hash


def test_lru_eviction_order_of_free_cached_blocks() -> None:
    kv = KVCache(block_size=4, num_blocks=4)
    a_tokens, b_tokens = list(range(8)), list(range(100, 108))
    a = _run(kv, a_tokens)
    a_hashes = list(a.block_hashes)
    kv.free(a)  # tail block is freed first, so it is evicted first
    b = _run(kv, b_tokens)
    b_hashes = list(b.block_hashes)
    kv.free(b)
    assert kv.usage == 0.0  # free cached blocks do not count as used
    assert all(kv.is_cached(h) for h in a_hashes + b_hashes)

    c = _seq(kv, [200, 201, 202, 203])
    assert kv.allocate(c, 4)
    assert not kv.is_cached(a_hashes[1])  # least recently used: A's tail
    assert kv.is_cached(a_hashes[0]) and all(kv.is_cached(h) for h in b_hashes)

    # Free queue now: A0, B1, B0. Hitting A0 takes it out of the queue; the new tail block
    # evicts B1, the oldest remaining free block.
    a2 = _seq(kv, [*a_tokens[:4], 50, 51])
    hit = kv.find_prefix(a2, 6)
    assert len(hit) == 1
    assert kv.allocate(a2, 6, hit)
    assert not kv.is_cached(b_hashes[1])
    kv.free(a2)
    # A0 went back to the end of the queue, so B0 (freed after A0 originally) goes first.
    d = _seq(kv, [300, 301, 302, 303])
    assert kv.allocate(d, 4)
    assert not kv.is_cached(b_hashes[0])
    assert kv.is_cached(a_hashes[0])


def test_shared_prefix_blocks_are_ref_counted() -> None:
    kv = KVCache(block_size=4, num_blocks=4)
    prefix = list(range(4))
    a = _run(kv, [*prefix, 10, 11])
    b = _seq(kv, [*prefix, 20, 21])
    hit = kv.find_prefix(b, 6)
    assert hit == a.blocks[:1]
    assert kv.allocate(b, 6, hit)
    assert kv.num_free_blocks == 1  # 2 for a, 1 more for b; the prefix block is shared
    kv.free(a)
    assert kv.num_free_blocks == 2  # the shared block is still held by b
    kv.free(b)
    assert kv.num_free_blocks == 4 and kv.usage == 0.0


def test_allocation_fails_without_side_effects() -> None:
    kv = KVCache(block_size=4, num_blocks=2)
    a = _run(kv, list(range(8)))
    b = _seq(kv, [9, 9, 9])
    assert not kv.allocate(b, 3)
    assert b.blocks == [] and kv.usage == 1.0
    kv.free(a)
    assert kv.allocate(b, 3)
