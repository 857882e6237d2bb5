"""The emulator publishes vLLM's KV events on real ZMQ sockets: PUB frames, replay, session ids,
evictions, ``GET /kv_event_sources``; and the proxy's decoder and index read them."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from marsproxy.bench.procs import free_port
from marsproxy.emulator.kv_events import parse_kv_events_config
from marsproxy.probes.kv_index import KVIndex
from marsproxy.probes.kv_wire import (
    BlockRemoved,
    BlockStored,
    decode_batch,
    replay_request,
    seq_of,
)
from tests.integration.emulator.conftest import StartEmulator

TOPIC = "kv"
FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "vllm-0.32-kv-events.json"


def _cfg(pub: int, replay: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
                       "topic": TOPIC})


async def _chat(http: aiohttp.ClientSession, base: str, text: str, session: str) -> int:
    async with http.post(f"{base}/v1/chat/completions", json={
        "model": "tiny-emulated", "messages": [{"role": "user", "content": text}], "max_tokens": 3,
        "ignore_eos": True, "session_id": session,
    }) as r:
        assert r.status == 200, await r.text()
        body = await r.json()
    details = body["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


async def _drain(sub: zmq.asyncio.Socket, quiet_s: float = 0.3) -> list[list[bytes]]:
    frames: list[list[bytes]] = []
    while await sub.poll(int(quiet_s * 1000)):
        frames.append(await sub.recv_multipart())
    return frames


async def test_publishes_replays_and_feeds_the_index(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    pub, rep = free_port(), free_port()
    server = await start_emulator(profile="tiny", time_scale=0.01, num_blocks=24,
                                  kv_events=parse_kv_events_config(_cfg(pub, rep)))
    base = str(server.make_url("")).rstrip("/")
    async with http.get(f"{base}/kv_event_sources") as r:
        sources = await r.json()
    assert sources["0"]["endpoint"] == f"tcp://*:{pub}" and sources["0"]["topic"] == TOPIC
    assert sources["0"]["publisher"] == "zmq" and sources["0"]["buffer_steps"] == 10_000

    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(f"tcp://127.0.0.1:{pub}")
    await asyncio.sleep(0.3)  # the subscription reaches the publisher
    index = KVIndex(replay=True, max_pending=100)
    index.replay_done(0.0, index.begin().replay_id)
    try:
        shared = "shared system prompt " * 20
        assert await _chat(http, base, shared + "first", "s1") == 0
        frames = await _drain(sub)
        cached = await _chat(http, base, shared + "second", "s2")
        assert cached > 0  # the shared prefix hit
        # enough distinct prompts to push the first ones out of 24 blocks
        for i in range(6):
            await _chat(http, base, f"unrelated {i} " * 40, f"x{i}")
        frames += await _drain(sub)

        assert all(len(f) == 3 and f[0] == TOPIC.encode() for f in frames)
        seqs = [seq_of(f[1]) for f in frames]
        assert seqs == list(range(len(seqs)))
        batches = [decode_batch(f[2]) for f in frames]
        events = [e for b in batches for e in b.events]
        first = next(e for e in events if isinstance(e, BlockStored))
        assert first.parent_block_hash is None and first.session_id == "s1"
        assert len(first.token_ids) == len(first.block_hashes) * first.block_size
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in first.block_hashes)
        assert any(isinstance(e, BlockRemoved) for e in events)  # evictions happened
        assert {e.session_id for e in events if isinstance(e, BlockStored)} >= {"s1", "x5"}

        for seq, b in zip(seqs, batches, strict=True):
            index.on_batch(seq, b, b.ts)
        assert index.blocks() > 0 and index.session_blocks("x5") > 0

        # replay from the middle: the same payloads, then the end marker
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{rep}")
        await dealer.send_multipart(replay_request(2))
        got: list[list[bytes]] = []
        while True:
            msg = await asyncio.wait_for(dealer.recv_multipart(), 5)
            assert msg[0] == b""
            if seq_of(msg[2]) == -1:
                assert msg[1] == b"" and msg[3] == b""
                break
            got.append(msg[1:])
        dealer.close(linger=0)
        assert got == frames[2:]
    finally:
        sub.close(linger=0)
        ctx.term()


async def test_without_the_flag_nothing_is_published(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator(profile="tiny", time_scale=0.01)
    base = str(server.make_url("")).rstrip("/")
    async with http.get(f"{base}/kv_event_sources") as r:
        assert r.status == 200 and await r.json() == {}


@pytest.mark.parametrize("bad", [
    "[]", "not json", '{"enable_kv_cache_events": true, "nope": 1}',
    '{"enable_kv_cache_events": true, "publisher": "kafka"}',
    '{"enable_kv_cache_events": true, "buffer_steps": -1}',
])
def test_flag_is_checked_like_vllms(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_kv_events_config(bad)


def _shapes(frames: list[list[bytes]]) -> dict[str, set[tuple[tuple[str, str], ...]]]:
    """Per event type, the (key, value type) sequences seen, in wire order."""
    out: dict[str, set[tuple[tuple[str, str], ...]]] = {}
    for _, _, payload in frames:
        assert payload[:2] == b"\x93\xcb"  # a 3-element array, a float64 ts first
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and isinstance(events, list) and rank == 0
        for e in events:
            shape = tuple((k, type(v).__name__) for k, v in e.items())
            out.setdefault(e["type"], set()).add(shape)
    return out


async def test_stream_has_the_form_of_real_vllms(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """The emulator's frames against those captured from vLLM 0.32: the same framing, and per
    event type the same fields in the same order with the same value types."""
    real: dict[str, Any] = json.loads(FIXTURE.read_text())
    real_frames = [[base64.b64decode(f) for f in fr] for fr in real["frames"]]
    pub, rep = free_port(), free_port()
    server = await start_emulator(profile="tiny", time_scale=0.01, num_blocks=24,
                                  kv_events=parse_kv_events_config(_cfg(pub, rep)))
    base = str(server.make_url("")).rstrip("/")
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(f"tcp://127.0.0.1:{pub}")
    await asyncio.sleep(0.3)
    try:
        shared = "shared system prompt " * 20
        await _chat(http, base, shared + "first", "a")
        await _chat(http, base, shared + "first and more of it " * 5, "a")  # extends: a parent
        for i in range(6):
            await _chat(http, base, f"unrelated {i} " * 40, f"x{i}")
        frames = await _drain(sub)
    finally:
        sub.close(linger=0)
        ctx.term()
    assert {len(f) for f in frames} == {len(f) for f in real_frames} == {3}
    assert {len(f[1]) for f in frames} == {len(f[1]) for f in real_frames} == {8}
    assert _shapes(frames) == _shapes(real_frames)
