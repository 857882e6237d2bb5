"""The KV index against an engine that misbehaves: lost removals (memory bounds) and events the
decoder cannot read (counted and skipped; the index never believes in blocks it cannot know)."""

from __future__ import annotations

import math

import msgpack

from marsproxy.probes.kv_index import KVIndex, Step
from marsproxy.probes.kv_wire import decode_batch
from tests.unit.probes.kv_events_helpers import BS, batch, stored, tokens


def index(**kw: int) -> KVIndex:
    ix = KVIndex(replay=False, max_pending=8, **kw)
    ix.begin()
    return ix


def wire_stored(toks: list[int], hashes: list[object], **extra: object) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": toks, "block_size": BS, "medium": "GPU", **extra}


def payload(*events: object, ts: float = 100.0) -> bytes:
    return msgpack.packb([ts, list(events), 0])


# -- memory bounds ----------------------------------------------------------------------------


def replaying(max_pending: int, **kw: int) -> KVIndex:
    """An index in sequence at batch 0, with a replay socket."""
    ix = KVIndex(replay=True, max_pending=max_pending, **kw)
    ix.replay_done(0.0, ix.begin().replay_id)
    ix.on_batch(0, batch(), 1.0)
    return ix


def test_a_replay_may_send_the_gap_and_max_pending_more() -> None:
    ix = replaying(3)
    rid = ix.on_batch(5, batch(stored(tokens(4), [5])), 1.0).replay_id  # needs 1..4
    for seq in range(1, 8):  # the gap, then 3 past the held batch (the worker went on)
        assert ix.on_batch(seq, batch(), 1.0, replay=rid) == Step()
    assert ix.awaits(rid) and ix.expected == 8
    assert not ix.on_batch(8, batch(), 1.0, replay=rid).reset  # one more: cut off
    assert ix.replays_cut_total == 1 and not ix.awaits(rid) and ix.synced
    assert ix.resyncs_total == 0 and ix.expected == 8 and ix.blocks() == 1  # nothing was lost


def test_a_replay_cut_off_with_its_gap_open_resyncs() -> None:
    """A publisher that sends the same batch over and over never fills the gap."""
    ix = replaying(3)
    rid = ix.on_batch(5, batch(stored(tokens(4), [5])), 1.0).replay_id
    for _ in range(7):
        ix.on_batch(0, batch(), 1.0, replay=rid)
    assert ix.awaits(rid) and ix.duplicates_total == 7
    assert ix.on_batch(0, batch(), 1.0, replay=rid).reset
    assert ix.replays_cut_total == 1 and ix.resyncs_total == 1 and not ix.replaying
    assert ix.expected == 6 and ix.resident_prefix_tokens(tokens(4)) == 4


def test_a_replay_at_a_connection_is_bounded_by_the_first_live_batch() -> None:
    ix = KVIndex(replay=True, max_pending=2)
    rid = ix.begin().replay_id
    ix.on_batch(4, batch(), 1.0)  # live, while the replay from 0 runs: it must reach 4
    for seq in range(6):  # 0..3, then 2 more
        ix.on_batch(seq, batch(), 1.0, replay=rid)
    assert ix.awaits(rid) and ix.replays_cut_total == 0
    ix.on_batch(6, batch(), 1.0, replay=rid)
    assert ix.replays_cut_total == 1 and ix.synced and ix.expected == 6


def test_held_batches_are_bounded_by_bytes() -> None:
    ix = replaying(100, max_pending_bytes=1000)
    rid = ix.on_batch(2, batch(), 1.0, size=600).replay_id
    ix.on_batch(1, batch(), 1.0, replay=rid, size=600)  # fills the gap: nothing held now
    assert ix.pending == 0 and ix.expected == 3
    ix.on_batch(4, batch(), 1.0, size=600)
    assert ix.on_batch(5, batch(), 1.0, size=300).replay_from is None  # 900 held
    assert ix.pending_overflows_total == 0 and ix.pending == 2
    assert ix.on_batch(6, batch(stored(tokens(4), [6])), 1.0, size=200).reset  # 1100
    assert ix.pending_overflows_total == 1 and ix.resyncs_total == 1
    assert ix.pending == 0 and ix.expected == 7 and ix.blocks() == 1


def test_lost_removals_never_hold_more_blocks_than_the_engine_has() -> None:
    """An engine whose removals never arrive (in sequence, so no gap shows it) stores on and on:
    the index keeps at most the engine's block count, dropping the oldest, and says so."""
    ix = index()
    ix.engine_blocks = 4
    for s in range(6):  # six 2-block prompts, never removed: 12 blocks on a 4-block engine
        ix.on_batch(s, batch(stored(tokens(8, 100 * s), [10 * s + 1, 10 * s + 2],
                                    session=f"s{s}")), 1.0)
    assert ix.blocks() == 4
    assert ix.dropped_blocks_total == 8
    assert ix.resident_prefix_tokens(tokens(8, 500)) == 8  # the newest are kept
    assert ix.resident_prefix_tokens(tokens(8, 0)) == 0  # the oldest are gone
    assert ix.session_block_counts() == {"s4": 2, "s5": 2}


def test_without_the_engines_size_a_documented_cap_holds_each_medium() -> None:
    ix = index(max_blocks=5)
    for s in range(8):
        ix.on_batch(s, batch(stored(tokens(4, 10 * s), [s + 1], medium="CPU",
                                    session=f"s{s}")), 1.0)
    assert ix.blocks_by_medium() == {"CPU": 5}
    assert ix.dropped_blocks_total == 3
    assert ix.session_block_counts("CPU") == {f"s{s}": 1 for s in range(3, 8)}


def test_media_beyond_a_few_are_not_kept() -> None:
    """A publisher naming a new medium in every event must not grow the index (nor the
    metrics' medium label) without bound."""
    ix = index()
    for s in range(50):
        ix.on_batch(s, batch(stored(tokens(4, 10 * s), [s + 1], medium=f"M{s}")), 1.0)
    assert len(ix.blocks_by_medium()) <= 8
    assert sum(ix.blocks_by_medium().values()) + ix.dropped_blocks_total == 50


# -- events the decoder cannot read -----------------------------------------------------------


def test_an_unknown_event_type_is_counted_and_the_rest_of_its_batch_applied() -> None:
    """A newer vLLM's extra event type must not cost the whole batch (nor, through the gap it
    leaves, everything the index knew)."""
    b = decode_batch(payload(wire_stored(tokens(4), [1]), {"type": "BlockPinned", "x": 1},
                             wire_stored(tokens(4, 10), [2])))
    ix = index()
    ix.on_batch(0, b, 1.0)
    assert ix.resident_prefix_tokens(tokens(4)) == 4
    assert ix.resident_prefix_tokens(tokens(4, 10)) == 4
    assert ix.bad_events_total == 1 and ix.resyncs_total == 0


def test_a_malformed_store_is_skipped_and_counted() -> None:
    ix = index()
    ix.on_batch(0, decode_batch(payload(wire_stored(tokens(4), [1]))), 1.0)
    bad = [wire_stored(["a", "b", "c", "d"], [2]),  # token ids not ints
           wire_stored(tokens(4), ["h"]),  # a hash as str
           wire_stored(tokens(4), [[1]]),  # a hash as list
           wire_stored(tokens(4, 20), [3], medium=7),  # a medium that is not a name
           wire_stored(tokens(4, 30), [4], block_size="4")]
    ix.on_batch(1, decode_batch(payload(*bad, wire_stored(tokens(4, 40), [5]))), 1.0)
    assert ix.bad_events_total == len(bad)
    assert ix.blocks_by_medium() == {"GPU": 2}  # 1 and 5; nothing of the bad ones
    assert ix.resident_prefix_tokens(tokens(4)) == 4
    assert ix.resident_prefix_tokens(tokens(4, 40)) == 4


def test_a_removal_that_cannot_be_read_forgets_every_block() -> None:
    """Which blocks went is unknown: believing in any of them could be wrong."""
    ix = index()
    ix.on_batch(0, decode_batch(payload(wire_stored(tokens(8), [1, 2]))), 1.0)
    ix.on_batch(1, decode_batch(payload({"type": "BlockRemoved", "block_hashes": "12",
                                         "medium": "GPU"})), 1.0)
    assert ix.blocks() == 0 and ix.resident_prefix_tokens(tokens(8)) == 0
    assert ix.bad_events_total == 1 and ix.resyncs_total == 1


def test_a_timestamp_that_is_not_finite_gives_no_lag() -> None:
    ix = index()
    for s, ts in enumerate((-math.inf, math.nan, math.inf)):
        ix.on_batch(s, decode_batch(payload(wire_stored(tokens(4, s * 10), [s + 1]), ts=ts)), 1.0)
        assert ix.last_lag_s is None or math.isfinite(ix.last_lag_s)
    assert ix.blocks() == 3
