"""The KV index against a real vLLM 0.32's event stream (tests/fixtures/vllm-0.32-kv-events.json):
the decoder reads every frame, and the index, fed the frames each request came after, predicts
the ``cached_tokens`` the engine reported for it."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from marsproxy.probes.kv_index import KVIndex
from marsproxy.probes.kv_wire import END_SEQ, BlockRemoved, BlockStored, decode_batch, seq_of

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "vllm-0.32-kv-events.json"


def load() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(FIXTURE.read_text())
    for key in ("frames", "replay"):
        doc[key] = [[base64.b64decode(f) for f in fr] for fr in doc[key]]
    return doc


def test_every_frame_decodes() -> None:
    doc = load()
    frames = doc["frames"]
    assert [seq_of(f[1]) for f in frames] == list(range(len(frames)))
    events = [e for f in frames for e in decode_batch(f[2]).events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and any(isinstance(e, BlockRemoved) for e in events)
    assert {e.session_id for e in stored} >= {"a", "b", "c", "x0"}
    assert all(len(e.token_ids) == len(e.block_hashes) * e.block_size for e in stored)
    # the replay socket resent every batch, then its end marker
    assert doc["replay"][:-1] == frames and doc["replay"][-1] == [b"", END_SEQ, b""]


def test_index_predicts_the_engines_cached_tokens() -> None:
    doc = load()
    frames = doc["frames"]
    index = KVIndex(replay=True, max_pending=16)
    index.replay_done(0.0, index.begin().replay_id)
    fed, hits = 0, 0
    for req in doc["requests"]:
        while fed < len(frames) and seq_of(frames[fed][1]) <= req["after_seq"]:
            index.on_batch(seq_of(frames[fed][1]), decode_batch(frames[fed][2]), 0.0)
            fed += 1
        assert index.predicted_cached_tokens(req["prompt_token_ids"]) == req["cached_tokens"]
        hits += req["cached_tokens"] > 0
    assert hits >= 4 and index.resyncs_total == 0 and index.unknown_removals_total == 0
