"""The engine's fast paths (flat block state, C-speed chain walks, the remembered head-of-queue
hit, reused hash chains) give exactly the results of the straightforward model in
reference_engine.py and reference_kv_cache.py.

Seeded agent-like workloads (append-only prompts sharing a system prefix, replies fed back as
history, aborts, a KV cache small enough to evict and preempt) run through both engines in
lockstep; every step must match: duration, batch, tokens, first tokens, finishes with their usage
and timings, preemptions, stats, free-queue order. Seeded random cache operations (in orders the
engine would never use), a hypothesis property on hash chains extended piece by piece, and
targeted tests of chain reuse and of the remembered hit's free-block count do the same below the
engine.
"""

from __future__ import annotations

import dataclasses
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marsproxy.emulator.engine import Engine, Policy, StepResult
from marsproxy.emulator.kv_cache import KVCache, KVSeq
from marsproxy.emulator.profiles import EngineProfile, get_profile
from marsproxy.emulator.request import RequestError
from marsproxy.emulator.step_time import StepTimeCoeffs
from marsproxy.emulator.tokenizer import filler_token_id

from .reference_engine import ReferenceEngine, RefStepResult
from .reference_kv_cache import KVCache as RefKVCache
from .reference_kv_cache import KVSeq as RefKVSeq

COEFFS = StepTimeCoeffs(a=1e-3, w=2e-3, b=1e-5, c=1e-4, d_dec=1e-7, d_pf=1e-9)


def _profile(rng: random.Random, long: bool) -> EngineProfile:
    return dataclasses.replace(
        get_profile("tiny"),
        step=COEFFS,
        block_size=rng.choice([1, 2]) if long else rng.choice([2, 4, 16]),
        # long: conversations past the 64 blocks from which finished chains are reused
        num_blocks=rng.randint(400, 900) if long else rng.randint(24, 160),
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.choice([32, 128, 512]),
        natural_output_tokens=rng.randint(2, 24),
    )


def _same_step(fast: StepResult, ref: RefStepResult) -> None:
    assert fast.duration == ref.duration
    assert fast.batch == ref.batch
    assert fast.new_tokens == ref.new_tokens
    assert fast.first_token == ref.first_token
    assert fast.finished == ref.finished
    assert fast.preempted == ref.preempted
    assert fast.preemptions_reported == ref.preemptions_reported
    assert fast.prompt_tokens == ref.prompt_tokens
    assert fast.generation_tokens == ref.generation_tokens


def _same_state(fast: Engine, ref: ReferenceEngine) -> None:
    assert dataclasses.asdict(fast.stats()) == dataclasses.asdict(ref.stats())
    assert fast.kv.free_queue_order() == ref.kv.free_queue_order()
    assert fast.kv.num_free_blocks == ref.kv.num_free_blocks


def _lockstep(seed: int, policy: Policy, long: bool = False) -> dict[str, int]:
    """Drive both engines with one seeded workload; returns counts of what the run exercised."""
    rng = random.Random(seed)
    prof = _profile(rng, long)
    fast, ref = Engine(prof, policy), ReferenceEngine(prof, policy)
    system = [rng.randrange(1000) for _ in range(rng.randint(0, 40))]
    histories: dict[int, list[int]] = {}
    in_flight: dict[str, int] = {}  # request id -> session
    seen = {"steps": 0, "preempted": 0, "hits": 0, "finished": 0, "aborted": 0}
    now, n_req, n_sessions = 0.0, 0, 0
    load = rng.choice([[0] * 9 + [1], [0, 0, 0, 0, 1], [0, 0, 0, 1, 2]])  # calls per step
    for _ in range(250):
        # New calls: a new session, or the next turn of an idle one (prompt = history + more).
        for _ in range(rng.choice(load)):
            idle = [s for s in histories if s not in in_flight.values()]
            if idle and rng.random() < 0.7:
                sid = rng.choice(idle)
            else:
                sid, n_sessions = n_sessions, n_sessions + 1
                histories[sid] = [*system, 5000 + sid]
            hist = histories[sid]
            hist.extend(rng.randrange(1000) for _ in range(rng.randint(1, 60)))
            n_req += 1
            rid = f"s{sid}#{n_req}"
            max_tokens = rng.choice([None, rng.randint(1, 30)])
            kwargs = {
                "max_tokens": max_tokens,
                # Not with max_tokens=None: that would generate up to the context length.
                "ignore_eos": max_tokens is not None and rng.random() < 0.7,
                "priority": rng.randint(0, 3),
                "now": now,
            }
            try:
                ref.add_request(rid, list(hist), **kwargs)  # type: ignore[arg-type]
            except RequestError as exc:
                with pytest.raises(RequestError, match=re.escape(str(exc))):
                    fast.add_request(rid, hist, **kwargs)  # type: ignore[arg-type]
                del histories[sid]
                continue
            fast.add_request(rid, hist, **kwargs)  # type: ignore[arg-type]
            in_flight[rid] = sid
        if in_flight and rng.random() < 0.01:
            rid = rng.choice(sorted(in_flight))
            assert fast.abort(rid, now) == ref.abort(rid, now)
            del in_flight[rid]
            seen["aborted"] += 1
        if not ref.has_work():
            assert not fast.has_work()
            now += 0.01
            continue
        r_ref, r_fast = ref.step(now), fast.step(now)
        _same_step(r_fast, r_ref)
        _same_state(fast, ref)
        now += r_ref.duration
        seen["steps"] += 1
        seen["preempted"] += len(r_ref.preempted)
        for fin in r_ref.finished:
            sid = in_flight.pop(fin.req_id)
            # The reply comes back as history, so the next turn can hit its blocks.
            histories[sid].extend(filler_token_id(i) for i in range(fin.completion_tokens))
            seen["hits"] += fin.cached_tokens
            seen["finished"] += 1
    return seen


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_engine_matches_reference_model(policy: Policy) -> None:
    totals = dict.fromkeys(("steps", "preempted", "hits", "finished", "aborted"), 0)
    for seed in range(30):
        for k, v in _lockstep(seed, policy, long=seed % 3 == 0).items():
            totals[k] += v
    # The workloads must exercise what the fast paths shortcut: hits, evictions, preemptions.
    assert totals["steps"] > 3000 and totals["finished"] > 500
    assert totals["preempted"] > 20 and totals["hits"] > 10_000 and totals["aborted"] > 20


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 9), max_size=200),
    cuts=st.lists(st.integers(0, 200), max_size=5),
    bs=st.sampled_from([1, 2, 3, 16]),
)
def test_hash_chain_extended_in_pieces_matches_reference(
    tokens: list[int], cuts: list[int], bs: int
) -> None:
    fast, ref = KVCache(bs, 4), RefKVCache(bs, 4)
    f_seq, r_seq = KVSeq(), RefKVSeq()
    for cut in [*sorted(cuts), len(tokens)]:  # the prompt grows, as turns and decodes do
        fast.extend_hashes(f_seq, tokens[:cut])
        ref.extend_hashes(r_seq, tokens[:cut])
        assert f_seq.block_hashes == r_seq.block_hashes


def test_next_turn_reuses_the_finished_chain_only_when_tokens_match() -> None:
    bs = 4
    fast, ref = KVCache(bs, 4096), RefKVCache(bs, 4096)
    system = list(range(2000))  # longer than the 64-block lookup key: every session shares it
    turns = {s: [*system, 10_000 + s, *range(s, s + 300)] for s in range(6)}
    first: dict[int, KVSeq] = {}
    for s, tokens in turns.items():
        seq = KVSeq()
        fast.hash_prompt(seq, tokens)
        tokens.extend(range(50, 90))  # the reply, as generated tokens append to token_ids
        fast.extend_hashes(seq, tokens)
        fast.remember_chain(list(tokens), seq)
        first[s] = seq
    for s, tokens in turns.items():
        nxt = [*tokens, *range(7, 200)]
        seq, r_seq = KVSeq(), RefKVSeq()
        fast.hash_prompt(seq, nxt)
        ref.extend_hashes(r_seq, nxt)
        assert seq.block_hashes == r_seq.block_hashes
        # Sessions 2..5 are among the four kept for the shared key: their chains are reused.
        reused = seq.block_hashes[500] is first[s].block_hashes[500]
        assert reused == (s >= 2)
    # Same first 64 blocks, different later tokens: hashed afresh, not taken from session 5.
    other = [*turns[5][:2200], 1, *turns[5][2201:]]
    seq, r_seq = KVSeq(), RefKVSeq()
    fast.hash_prompt(seq, other)
    ref.extend_hashes(r_seq, other)
    assert seq.block_hashes == r_seq.block_hashes
    assert seq.block_hashes[500] is not first[5].block_hashes[500]


def test_remembered_hit_counts_free_blocks_through_admit_and_release() -> None:
    """A preempted request comes back to the head of the queue: the remembered count of its
    free hit blocks must follow its own admissions and releases, and a neighbour's that shares
    its prefix."""
    bs = 2
    fast, ref = KVCache(bs, 14), RefKVCache(bs, 14)
    x, rx, y, ry = KVSeq(), RefKVSeq(), KVSeq(), RefKVSeq()
    x_tokens = list(range(17))
    y_tokens = [*x_tokens[:8], 50, 51]  # shares x's first four blocks
    for kv, seq, tokens in ((fast, x, x_tokens), (ref, rx, x_tokens), (fast, y, y_tokens),
                            (ref, ry, y_tokens)):
        kv.extend_hashes(seq, tokens)  # type: ignore[arg-type]
    for cycle in range(6):
        if cycle % 2:  # the neighbour takes the shared blocks (not through fast's lookup)
            y_hit = ref.find_prefix(ry, len(y_tokens))
            assert ref.allocate(ry, len(y_tokens), y_hit)
            assert fast.allocate(y, len(y_tokens), y_hit)
        hit = ref.find_prefix(rx, len(x_tokens))
        assert fast.find_prefix(x, len(x_tokens)) == hit
        for total in range(len(hit) * bs, 40):  # every answer near the limit agrees
            assert fast.can_allocate(x, total, hit) == ref.can_allocate(rx, total, hit)
        assert fast.allocate(x, len(x_tokens), hit) == ref.allocate(rx, len(x_tokens), hit)
        fast.cache_full_blocks(x, len(x_tokens))
        ref.cache_full_blocks(rx, len(x_tokens))
        fast.free(x)
        ref.free(rx)
        if cycle % 2:
            fast.free(y)
            ref.free(ry)
        assert fast.free_queue_order() == ref.free_queue_order()


_OPS = ("prompt", "find", "find", "find_short", "run", "alloc", "alloc", "free")


def test_cache_operations_match_reference() -> None:
    """Random cache operations in any order (a single-slot memo, evictions under it, lookups
    with shorter prompts): every answer and the whole cache state match the reference. Seeded
    random rather than hypothesis: the interesting sequences (look up, evict under the remembered
    hit, look up again) are long and hypothesis rarely builds them."""
    for seed in range(1500):
        rng = random.Random(seed)
        ops = [(rng.choice(_OPS), rng.randint(0, 2), rng.randint(1, 12))
               for _ in range(rng.randint(10, 80))]
        _cache_ops_match(ops, rng.choice([1, 2, 4]), rng.randint(3, 16))


def _cache_ops_match(ops: list[tuple[str, int, int]], bs: int, num_blocks: int) -> None:
    fast, ref = KVCache(bs, num_blocks), RefKVCache(bs, num_blocks)
    seqs = [(KVSeq(), RefKVSeq(), [i % 2]) for i in range(3)]  # two share a start
    for op, i, n in ops:
        f_seq, r_seq, tokens = seqs[i]
        if op == "prompt":  # the prompt grows (append-only), sometimes by a shared pattern
            tokens.extend([7] * n if n % 2 else range(n))
            fast.extend_hashes(f_seq, tokens)
            ref.extend_hashes(r_seq, tokens)
            assert f_seq.block_hashes == r_seq.block_hashes
        elif op in ("find", "find_short"):
            num = max(1, len(tokens) - n) if op == "find_short" else len(tokens)
            assert fast.find_prefix(f_seq, num) == ref.find_prefix(r_seq, num)
        elif op == "run":  # admit the whole prompt after its hit, compute it, cache it
            if not r_seq.blocks:
                hit = ref.find_prefix(r_seq, len(tokens))
                assert fast.find_prefix(f_seq, len(tokens)) == hit
                ok = ref.allocate(r_seq, len(tokens), hit)
                assert fast.allocate(f_seq, len(tokens), hit) == ok
            fast.cache_full_blocks(f_seq, min(len(tokens), len(f_seq.blocks) * bs))
            ref.cache_full_blocks(r_seq, min(len(tokens), len(r_seq.blocks) * bs))
        elif op == "alloc":  # more blocks for a sequence (evicts least recently used ones)
            total = len(r_seq.blocks) * bs + n
            assert fast.can_allocate(f_seq, total) == ref.can_allocate(r_seq, total)
            assert fast.allocate(f_seq, total) == ref.allocate(r_seq, total)
        else:
            fast.free(f_seq)
            ref.free(r_seq)
        assert f_seq.blocks == r_seq.blocks
        assert f_seq.num_cached_blocks == r_seq.num_cached_blocks
        assert fast.free_queue_order() == ref.free_queue_order()
        assert fast.usage == ref.usage
        for _, r, _t in seqs:
            assert all(fast.is_cached(h) == ref.is_cached(h) for h in r.block_hashes)
