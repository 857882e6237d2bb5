"""The proxy's own cached-token predictions against a real vLLM 0.32 (CPU build, tiny model,
40 blocks of 32 tokens): ``marsproxy_kv_predictions_total{worker,outcome}`` counted by the
gateway, which tokenizes each prompt on the worker (``/tokenize``), predicts from its KV index
just before dispatch and compares with ``usage.prompt_tokens_details.cached_tokens``.

Serial calls (the index has seen every earlier step): at least 99 % exact or within one block
(asserted). Waves of four at once: measured and printed, not asserted (a prediction describes
the cache when it is made; the requests running beside it evict before the engine looks)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import aiohttp
import pytest

from marsproxy.config import load_config
from marsproxy.gateway.http.app import Running, start

SETTLE_S = 0.3  # serial: the previous call's last KV events reach the index meanwhile
VOCAB = ("alpha", "beta", "gamma", "delta", "kernel", "queue", "thread", "buffer", "socket",
         "parse", "render", "commit", "branch", "merge", "token", "block", "cache", "prefix")
OUTCOMES = ("exact", "within_block", "off")


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        yield s


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def _counts(proxy: Running) -> dict[str, float]:
    tally = proxy.gateway.metrics.kv_predictions
    return {o: tally.labels("vllm", o).value for o in OUTCOMES}


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {o: after[o] - before[o] for o in OUTCOMES}


async def _chat(http: aiohttp.ClientSession, base: str, session: str,
                messages: list[dict[str, str]]) -> None:
    async with http.post(f"{base}/v1/chat/completions", headers={"x-session-id": session},
                         json={"model": "tiny", "messages": messages, "max_tokens": 4,
                               "ignore_eos": True, "temperature": 0}) as r:
        assert r.status == 200, await r.text()


async def test_the_proxy_predicts_cached_tokens(
    vllm_kv: tuple[str, int, int], http: aiohttp.ClientSession
) -> None:
    url, pub, replay = vllm_kv
    proxy = await start(load_config(environ={}, overrides={
        "server": {"port": 0}, "probes": {"nvml": {"enabled": False}},
        "workers": [{"url": url, "name": "vllm", "kv_events": {
            "endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "topic": "kv"}}],
    }))
    base = f"http://127.0.0.1:{proxy.port}"
    gw = proxy.gateway
    try:
        assert gw.kv_use is not None
        for _ in range(300):
            if gw.kv_use.active():
                break
            await asyncio.sleep(0.1)
        rng = random.Random(11)
        system = {"role": "system", "content": "You are a coding agent. " + _words(rng, 100)}
        convs = {s: [system, {"role": "user", "content": f"task {s}: " + _words(rng, 40)}]
                 for s in "abcd"}

        def grow(m: list[dict[str, str]]) -> list[dict[str, str]]:
            return [*m, {"role": "assistant", "content": _words(rng, 6)},
                    {"role": "user", "content": "tool output " + _words(rng, 30)}]

        # 1. serial: four sessions, three turns, evicting prompts before the third
        before = _counts(proxy)
        for turn in range(3):
            if turn == 2:
                for i in range(4):
                    await _chat(http, base, f"x{i}",
                                [{"role": "user", "content": f"other {i} " + _words(rng, 220)}])
                    await asyncio.sleep(SETTLE_S)
            for s in convs:
                if turn:
                    convs[s] = grow(convs[s])
                await _chat(http, base, s, convs[s])
                await asyncio.sleep(SETTLE_S)
        serial = _delta(before, _counts(proxy))
        n = sum(serial.values())
        good = serial["exact"] + serial["within_block"]
        print(f"\nserial: {serial} ({good:.0f}/{n:.0f} exact or within one block)")

        # 2. waves of four at once (measured only)
        before = _counts(proxy)
        for _ in range(3):
            convs = {s: grow(m) for s, m in convs.items()}
            await asyncio.gather(*(_chat(http, base, s, m) for s, m in convs.items()))
            await asyncio.sleep(SETTLE_S)
        waves = _delta(before, _counts(proxy))
        print(f"four at once: {waves}")
        m = gw.metrics
        calls = m.kv_tokenize.labels("ok").value
        cost = m.kv_tokenize_seconds.labels().value
        print(f"tokenize: {calls:.0f} calls, mean {1000 * cost / max(1.0, calls):.1f} ms")
        assert n == 16 and good >= 0.99 * n
        assert sum(waves.values()) == 12
    finally:
        await proxy.stop()
