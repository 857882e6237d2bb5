"""Against a real vLLM 0.32 (CPU build, tiny model) publishing KV events: the proxy's KV index
agrees with the engine. Agent-like sessions sharing a system prompt, turns that extend earlier
ones, unrelated prompts that evict, all through the proxy one request at a time; before each
request the index predicts the prompt's cached tokens, and the engine's
``usage.prompt_tokens_details.cached_tokens`` says what it found. A second proxy started after
the run rebuilds the same index from the replay socket alone.

Needs the real-vLLM install and ``MARS_REAL_VLLM_TESTS=1`` (conftest.py); one server start
(20-90 s on 2 cores) and about 40 requests.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import aiohttp
import pytest

from marsproxy.config import load_config
from marsproxy.gateway.http.app import Running, start
from marsproxy.probes.kv_index import KVIndex
from tests.integration.real_vllm.conftest import KV_BLOCK_SIZE as BLOCK_SIZE

SETTLE_S = 0.4  # no new batch for this long: the engine's last step is in the index
VOCAB = ("alpha", "beta", "gamma", "delta", "kernel", "queue", "thread", "buffer", "socket",
         "parse", "render", "commit", "branch", "merge", "token", "block", "cache", "prefix")


async def _proxy(url: str, pub: int, replay: int) -> Running:
    cfg = load_config(environ={}, overrides={
        "server": {"port": 0}, "probes": {"nvml": {"enabled": False}},
        "workers": [{"url": url, "name": "vllm", "kv_events": {
            "endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "topic": "kv"}}],
    })
    return await start(cfg)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        yield s


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def _workload(seed: int = 11) -> list[tuple[str, list[dict[str, str]]]]:
    """Four sessions, three turns each, unrelated prompts between the second and third turn."""
    rng = random.Random(seed)
    system = {"role": "system", "content": "You are a coding agent. " + _words(rng, 100)}
    convs = {s: [system, {"role": "user", "content": f"task {s}: " + _words(rng, 40)}]
             for s in ("a", "b", "c", "d")}
    order: list[tuple[str, list[dict[str, str]]]] = []
    for turn in range(3):
        if turn == 2:
            order += [(f"x{i}", [{"role": "user", "content": f"other {i} " + _words(rng, 220)}])
                      for i in range(4)]
        for s in convs:
            if turn:
                convs[s] = [*convs[s], {"role": "assistant", "content": _words(rng, 6)},
                            {"role": "user", "content": "tool output " + _words(rng, 35)}]
            order.append((s, list(convs[s])))
    return order


async def _settled(index: KVIndex) -> None:
    last = -2
    for _ in range(100):
        await asyncio.sleep(SETTLE_S)
        seq = -1 if index.last_seq is None else index.last_seq
        if seq == last:
            return
        last = seq


async def _until_usable(proxy: Running) -> KVIndex:
    shell = proxy.gateway.kv_events
    assert shell is not None
    for _ in range(300):
        ix = shell.index("vllm")
        if ix is not None:
            return ix
        await asyncio.sleep(0.1)
    raise AssertionError("the KV index never became usable")


Row = tuple[str, int, int, int]  # session, prompt tokens, predicted, cached


async def _call(http: aiohttp.ClientSession, url: str, base: str, index: KVIndex,
                session: str, messages: list[dict[str, str]], settle: bool = True) -> Row:
    """Predict the prompt's cached tokens from the index, send it through the proxy, and
    return both with what the engine reported."""
    async with http.post(f"{url}/tokenize", json={"model": "tiny", "messages": messages}) as r:
        tokens = (await r.json())["tokens"]
    if settle:
        await _settled(index)
    predicted = index.predicted_cached_tokens(tokens)
    async with http.post(f"{base}/v1/chat/completions", headers={"x-session-id": session},
                         json={"model": "tiny", "messages": messages, "max_tokens": 4,
                               "ignore_eos": True, "temperature": 0,
                               "return_token_ids": True}) as r:
        assert r.status == 200, await r.text()
        body = await r.json()
    assert body["prompt_token_ids"] == tokens  # /tokenize saw the same prompt
    cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return session, len(tokens), predicted, cached


def _rates(name: str, rows: list[Row]) -> tuple[int, int]:
    exact = sum(p == c for _, _, p, c in rows)
    near = sum(abs(p - c) <= BLOCK_SIZE for _, _, p, c in rows)
    print(f"\n{name}: {exact}/{len(rows)} exact, {near}/{len(rows)} within one block")
    for s, n, p, c in rows:
        print(f"  session {s:3} prompt {n:4} predicted {p:4} cached {c:4}")
    return exact, near


def _next_turn(rng: random.Random, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": _words(rng, 6)},
            {"role": "user", "content": "tool output " + _words(rng, 30)}]


async def test_index_agrees_with_the_engine(
    vllm_kv: tuple[str, int, int], http: aiohttp.ClientSession
) -> None:
    url, pub, replay = vllm_kv
    proxy = await _proxy(url, pub, replay)
    base = f"http://127.0.0.1:{proxy.port}"
    try:
        index = await _until_usable(proxy)
        # 1. one request at a time: the index has seen every step before each prediction
        work = _workload()
        rows = [await _call(http, url, base, index, s, m) for s, m in work]
        exact, near = _rates("one at a time", rows)
        assert sum(c > 0 for *_, c in rows) >= 8  # prefix hits happened ...
        assert any(c == 0 and s in "abcd" for s, _, _, c in rows[12:])  # ... and evictions
        assert exact >= 0.9 * len(rows) and near == len(rows)
        assert index.resyncs_total == 0 and index.unknown_removals_total == 0
        assert index.session_blocks("anon/id/d") > 0  # the proxy's keys reached the events

        # 2. waves of four at once: predictions race the engine (measured, not asserted)
        rng = random.Random(5)
        last = {s: m for s, m in work if s in "abcd"}
        burst: list[Row] = []
        for _ in range(3):
            last = {s: _next_turn(rng, m) for s, m in last.items()}
            await _settled(index)
            burst += await asyncio.gather(*(_call(http, url, base, index, s, m, settle=False)
                                            for s, m in last.items()))
        _rates("four at once", burst)

        # 3. one at a time again: after the burst the index is still right
        last = {s: _next_turn(rng, m) for s, m in last.items()}
        after = [await _call(http, url, base, index, s, m) for s, m in last.items()]
        exact, _ = _rates("one at a time after the burst", after)
        assert exact == len(after) and index.resyncs_total == 0
        print(f"events {index.events_total}, resident blocks {index.blocks()}")

        # 4. a proxy that comes later learns the same from the replay socket
        late = await _proxy(url, pub, replay)
        try:
            again = await _until_usable(late)
            assert again.blocks() == index.blocks() and again.last_seq == index.last_seq
            for session, messages in last.items():
                async with http.post(f"{url}/tokenize", json={"model": "tiny",
                                                              "messages": messages}) as r:
                    tokens = (await r.json())["tokens"]
                assert again.resident_prefix_tokens(tokens) == index.resident_prefix_tokens(
                    tokens), session
        finally:
            await late.stop()
    finally:
        await proxy.stop()
