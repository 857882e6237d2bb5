"""The KV index (sans-IO): sequencing (gaps, replay, restarts), events, prefix residency."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marsproxy.probes.kv_index import KVIndex, Step, chain_keys
from marsproxy.probes.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireError,
    decode_batch,
)
from tests.unit.probes.kv_events_helpers import BS, batch, stored, tokens


def index(replay: bool = True, max_pending: int = 8) -> KVIndex:
    ix = KVIndex(replay=replay, max_pending=max_pending)
    ix.begin()
    return ix


def test_prefix_residency_by_token_chain() -> None:
    ix = index()
    prompt = tokens(12)  # three full blocks
    ix.on_batch(0, batch(stored(prompt[:8], [11, 12], session="a")), 101.0)
    ix.on_batch(1, batch(stored(prompt[8:12], [13], parent=12, session="a")), 101.0)
    assert ix.resident_prefix_tokens(prompt) == 12
    assert ix.resident_prefix_tokens([*prompt, 99, 98]) == 12
    # the engine always computes the last prompt token: a 12-token prompt hits 8
    assert ix.predicted_cached_tokens(prompt) == 8
    assert ix.predicted_cached_tokens([*prompt, 99]) == 12
    # a different second block: the chain stops after the first
    other = [*prompt[:4], 7, 7, 7, 7, *prompt[8:]]
    assert ix.resident_prefix_tokens(other) == 4
    # removing the middle block cuts the prefix there
    ix.on_batch(2, batch(BlockRemoved((12,), "GPU")), 102.0)
    assert ix.resident_prefix_tokens(prompt) == 4
    assert ix.blocks() == 2 and ix.session_blocks("a") == 2
    assert chain_keys(prompt, BS)[0] == chain_keys(prompt[:4], BS)[0]


def test_an_event_storing_no_block_does_not_change_the_block_size() -> None:
    ix = index()
    prompt = tokens(8)
    ix.on_batch(0, batch(stored(prompt, [11, 12], session="a")), 101.0)
    empty = BlockStored((), None, (), 16, "GPU", None)  # no block: says nothing of their size
    ix.on_batch(1, batch(empty), 101.0)
    assert ix.block_size == BS and ix.predicted_cached_tokens([*prompt, 99]) == 8


def test_hash_values_do_not_matter_only_tokens() -> None:
    """Another process's hashes (bytes, other algorithm) give the same residency."""
    ix = index()
    prompt = tokens(8, 50)
    ix.on_batch(0, batch(stored(prompt, [b"\x01" * 32, b"\x02" * 32])), 1.0)  # type: ignore[list-item]
    assert ix.resident_prefix_tokens(prompt) == 8


def test_unknown_parent_and_salted_blocks_never_match() -> None:
    ix = index()
    prompt = tokens(8)
    ix.on_batch(0, batch(stored(prompt[4:], [22], parent=21)), 1.0)  # parent never seen
    salted = BlockStored((31,), None, tuple(prompt[:4]), BS, "GPU", salted=True)
    ix.on_batch(1, batch(salted), 1.0)
    assert ix.blocks() == 2
    assert ix.resident_prefix_tokens(prompt) == 0


def test_sessions_counts() -> None:
    ix = index()
    ix.on_batch(0, batch(stored(tokens(8), [1, 2], session="a"),
                         stored(tokens(4, 100), [3], session="b")), 1.0)
    assert (ix.session_blocks("a"), ix.session_blocks("b"), ix.sessions()) == (2, 1, 2)
    # a second holder of block 1 stored by b: the latest session owns it
    ix.on_batch(1, batch(stored(tokens(4), [1], session="b")), 1.0)
    assert (ix.session_blocks("a"), ix.session_blocks("b"), ix.blocks()) == (1, 2, 3)
    ix.on_batch(2, batch(BlockRemoved((1, 1, 2, 3), "GPU")), 1.0)
    assert ix.sessions() == 0 and ix.blocks() == 0 and ix.session_blocks("b") == 0


def test_duplicate_holders_of_one_hash_are_counted() -> None:
    """Two blocks computed at once for the same prefix: vLLM stores and removes the hash twice."""
    ix = index()
    ix.on_batch(0, batch(stored(tokens(4), [7]), stored(tokens(4), [7])), 1.0)
    ix.on_batch(1, batch(BlockRemoved((7,), "GPU")), 1.0)
    assert ix.resident_prefix_tokens(tokens(4)) == 4
    ix.on_batch(2, batch(BlockRemoved((7,), "GPU")), 1.0)
    assert ix.resident_prefix_tokens(tokens(4)) == 0 and ix.blocks() == 0


def test_media_are_separate() -> None:
    ix = index()
    ix.on_batch(0, batch(stored(tokens(4), [1]), stored(tokens(4), [1], medium="CPU")), 1.0)
    ix.on_batch(1, batch(BlockRemoved((1,), "GPU")), 1.0)
    assert ix.blocks_by_medium() == {"GPU": 0, "CPU": 1}
    assert ix.resident_prefix_tokens(tokens(4)) == 0
    assert ix.resident_prefix_tokens(tokens(4), medium="CPU") == 4


def test_all_blocks_cleared() -> None:
    ix = index()
    ix.on_batch(0, batch(stored(tokens(8), [1, 2], session="a")), 1.0)
    ix.on_batch(1, batch(AllBlocksCleared()), 1.0)
    assert ix.blocks() == 0 and ix.sessions() == 0 and ix.resident_prefix_tokens(tokens(8)) == 0


def test_gap_asks_for_replay_and_fills_in_order() -> None:
    ix = index()
    ix.replay_done(0.0, ix.replay_id)  # the initial replay found nothing
    ix.on_batch(0, batch(stored(tokens(4), [1])), 1.0)
    step = ix.on_batch(3, batch(BlockRemoved((1,), "GPU")), 1.0)
    assert step.replay_from == 1 and not step.reset and ix.pending == 1
    # a second gap while the replay runs asks nothing more
    assert ix.on_batch(4, batch(stored(tokens(4, 40), [4])), 1.0).replay_from is None
    ix.on_batch(1, batch(stored(tokens(4, 10), [2])), 1.0, replay=ix.replay_id)
    ix.on_batch(2, batch(stored(tokens(4, 20), [3])), 1.0, replay=ix.replay_id)
    ix.on_batch(3, batch(BlockRemoved((1,), "GPU")), 1.0, replay=ix.replay_id)  # duplicate
    assert ix.replay_done(1.0, ix.replay_id) == type(step)()
    assert ix.expected == 5 and ix.pending == 0 and ix.duplicates_total == 1
    assert ix.blocks() == 3 and ix.resyncs_total == 0  # 2, 3, 4 (1 was removed)


def test_gap_replay_cannot_fill_resyncs_conservatively() -> None:
    ix = index()
    ix.replay_done(0.0, ix.replay_id)
    ix.on_batch(0, batch(stored(tokens(4), [1])), 1.0)
    assert ix.on_batch(5, batch(stored(tokens(4, 50), [5])), 1.0).replay_from == 1
    step = ix.replay_done(2.0, ix.replay_id)  # the publisher's buffer no longer held 1..4
    assert step.reset and ix.resyncs_total == 1
    assert ix.resident_prefix_tokens(tokens(4)) == 0  # forgotten: may have been removed
    assert ix.resident_prefix_tokens(tokens(4, 50)) == 4 and ix.expected == 6


def test_too_many_held_batches_resync() -> None:
    ix = index(max_pending=2)
    ix.replay_done(0.0, ix.replay_id)
    ix.on_batch(0, batch(), 1.0)
    ix.on_batch(2, batch(), 1.0)
    ix.on_batch(3, batch(), 1.0)
    assert ix.on_batch(4, batch(stored(tokens(4), [9])), 1.0).reset
    assert ix.expected == 5 and ix.blocks() == 1


def test_without_replay_a_gap_resyncs_at_once() -> None:
    ix = index(replay=False)
    ix.on_batch(10, batch(stored(tokens(4), [1])), 1.0)  # joins mid-stream: accepted
    assert ix.blocks() == 1
    step = ix.on_batch(12, batch(stored(tokens(4, 8), [2])), 1.0)
    assert step.reset and step.replay_from is None
    assert ix.blocks() == 1 and ix.expected == 13


def test_restart_sequence_going_back_resets_and_replays() -> None:
    ix = index()
    ix.replay_done(0.0, ix.replay_id)
    for s in range(5):
        ix.on_batch(s, batch(stored(tokens(4, 10 * s), [s + 1])), 1.0)
    assert ix.blocks() == 5
    step = ix.on_batch(2, batch(stored(tokens(4, 90), [90])), 1.0)  # a new process's seq 2
    assert step.reset and step.replay_from == 0 and ix.resyncs_total == 1
    assert ix.blocks() == 0
    ix.on_batch(0, batch(stored(tokens(4, 70), [70])), 1.0, replay=ix.replay_id)
    ix.on_batch(1, batch(stored(tokens(4, 80), [80])), 1.0, replay=ix.replay_id)
    assert ix.blocks() == 3 and ix.expected == 3
    # restart seen at its first batch: nothing to replay
    step = ix.on_batch(0, batch(stored(tokens(4), [1])), 1.0)
    assert step.reset and step.replay_from is None and ix.blocks() == 1


def test_begin_asks_for_history_from_zero() -> None:
    ix = KVIndex(replay=True, max_pending=4)
    assert ix.begin().replay_from == 0
    ix.on_batch(3, batch(stored(tokens(4), [1])), 1.0)  # live, while the replay runs
    assert ix.pending == 1 and ix.blocks() == 0
    for s in range(3):
        ix.on_batch(s, batch(), 1.0, replay=ix.replay_id)
    assert ix.blocks() == 1 and not ix.synced  # until the replay says it is complete
    assert not ix.replay_done(1.0, ix.replay_id).reset and ix.synced


def test_a_superseded_replay_feeds_nothing() -> None:
    """A reconnection (or a restart) started the index over while the old replay still came."""
    ix = index()
    old = ix.replay_id
    ix.on_batch(0, batch(stored(tokens(4), [1])), 1.0, replay=old)
    new = ix.begin()  # reconnected
    assert new.replay_id != old and ix.awaits(new.replay_id) and not ix.awaits(old)
    ix.on_batch(1, batch(stored(tokens(4, 10), [2])), 1.0, replay=old)  # ahead: was held
    assert ix.replay_done(1.0, old) == Step() and ix.replaying  # nor does its end count
    assert ix.stale_replay_batches_total == 1 and ix.pending == 0 and ix.blocks() == 0
    ix.on_batch(0, batch(stored(tokens(4, 20), [3])), 1.0, replay=new.replay_id)
    assert ix.replay_done(1.0, new.replay_id) == Step() and ix.synced and not ix.replaying
    assert ix.blocks() == 1 and ix.resident_prefix_tokens(tokens(4, 20)) == 4
    # a live batch going back (a restart) supersedes a gap's replay the same way
    gap = ix.on_batch(3, batch(), 1.0)
    assert gap.replay_from == 1
    restart = ix.on_batch(0, batch(stored(tokens(4, 30), [4])), 1.0)
    ix.on_batch(1, batch(stored(tokens(4, 40), [5])), 1.0, replay=gap.replay_id)
    assert restart.reset and ix.stale_replay_batches_total == 2 and ix.expected == 1
    assert ix.resident_prefix_tokens(tokens(4, 40)) == 0


def test_rate_and_lag() -> None:
    ix = KVIndex(replay=False, max_pending=4, rate_window_s=10.0)
    ix.on_batch(0, batch(stored(tokens(4), [1]), stored(tokens(4, 4), [2], parent=1), ts=99.5),
                100.0)
    assert ix.last_lag_s == pytest.approx(0.5)
    assert ix.events_per_s(100.0) == pytest.approx(0.2)
    assert ix.events_per_s(111.0) == 0.0
    assert ix.events_total == 2 and ix.batches_total == 1


def test_decode_rejects_garbage() -> None:
    with pytest.raises(WireError):
        decode_batch(b"\xc1")
    with pytest.raises(WireError):
        decode_batch(msgpack.packb({"ts": 1}))
    # an event it cannot read costs that event, not its batch
    odd = decode_batch(msgpack.packb([1.0, [{"type": "Nope"}, {"type": "BlockStored",
                                            "block_hashes": [1], "token_ids": ["x"],
                                            "block_size": 4}]]))
    assert [type(e).__name__ for e in odd.events] == ["Unreadable", "Unreadable"]
    ok = decode_batch(msgpack.packb([1.0, [{"type": "AllBlocksCleared"}]]))
    assert ok.events == (AllBlocksCleared(),) and ok.data_parallel_rank is None


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.builds(
    msgpack.packb, st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
        | st.text(max_size=10) | st.binary(max_size=10),
        lambda inner: st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["type", "block_hashes", "token_ids", "block_size",
                                           "parent_block_hash", "medium", "extra_keys"]),
                          inner, max_size=5)
        | st.just({"type": "BlockStored"}), max_leaves=20))))
def test_decoder_answers_a_batch_or_wire_error(payload: bytes) -> None:
    """Whatever a socket delivers: a batch the index can apply, or WireError; nothing else."""
    try:
        b = decode_batch(payload)
    except WireError:
        return
    ix = index()
    ix.on_batch(0, b, 1.0)
