"""What ``bench live --vllm-url`` learns from and does to a real vLLM, against a fake one that
answers as vLLM 0.32 does (model card, /metrics page, /tokenize, streamed completions,
/reset_prefix_cache)."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from marsproxy.bench.agent import filler
from marsproxy.bench.live_vllm import (
    VllmFacts,
    _calibrate,
    ideal_seconds,
    reset_prefix_cache,
)
from marsproxy.bench.local import start_local
from marsproxy.runs.workload import PlannedSession, PlannedTurn

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def _facts(**kw: Any) -> VllmFacts:
    base: dict[str, Any] = dict(
        model="m", max_model_len=4096, kv_capacity_tokens=8192, chars_per_token=4.5,
        call_s=0.02, prefill_s_per_token=0.001, decode_s_per_token=0.01,
        calibration_context=1536)
    return VllmFacts(**{**base, **kw})


def test_ideal_prices_uncached_prompt_and_output_and_adds_tools() -> None:
    plan = PlannedSession("s", "t", 0.0, (
        PlannedTurn(1000, 11, 2.0, "test"),
        PlannedTurn(1500, 21, None, "other"),
    ))
    llm, tools = ideal_seconds(plan, _facts())
    # call 1: 0.02 + 1000 × 0.001 + 10 × 0.01; call 2: 0.02 + (1500 - 1011) × 0.001 + 20 × 0.01
    assert llm == pytest.approx(1.12 + 0.02 + 0.489 + 0.2)
    assert tools == 2.0


def test_filler_follows_chars_per_token_and_keeps_the_emulator_size() -> None:
    assert len(filler(100, random.Random(0))) == 400
    assert filler(100, random.Random(0)) == filler(100, random.Random(0), 4.0)
    assert len(filler(100, random.Random(0), 4.67)) == 467


class FakeVllm:
    def __init__(self, reset_answers: list[int | dict[str, Any]]) -> None:
        self.reset_answers = reset_answers
        self.resets = 0
        self.completions: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/reset_prefix_cache", self.reset)
        return app

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "medium", "object": "model", "max_model_len": 4096}]})

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=(FIXTURES / "vllm-0.32-metrics-idle.txt").read_text())

    async def tokenize(self, req: web.Request) -> web.Response:
        body = await req.json()
        # a tokenizer of 5 characters per token
        return web.json_response({"count": len(body["prompt"]) // 5, "max_model_len": 4096})

    async def complete(self, req: web.Request) -> web.StreamResponse:
        body = await req.json()
        self.completions.append(body)
        resp = web.StreamResponse()
        await resp.prepare(req)
        for _ in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": "x"}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def reset(self, _: web.Request) -> web.Response:
        self.resets += 1
        answer = self.reset_answers.pop(0) if self.reset_answers else {"success": True}
        if isinstance(answer, int):
            return web.Response(status=answer)
        return web.json_response(answer)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_calibration_reads_the_facts_and_times_token_id_prompts() -> None:
    fake = FakeVllm([])
    server = await start_local(fake.app())
    try:
        facts = await _calibrate(server.url, seed=0)
    finally:
        await server.stop()
    assert facts.model == "medium" and facts.max_model_len == 4096
    assert facts.kv_capacity_tokens is not None and facts.kv_capacity_tokens > 0
    assert facts.chars_per_token == pytest.approx(5.0, abs=0.01)
    assert facts.calibration_context == 1536
    assert facts.prefill_s_per_token >= 0 and facts.decode_s_per_token >= 0
    # token-id prompts of fresh ids (no prefix-cache hit), ignore_eos for exact lengths
    long = [b for b in fake.completions if len(b["prompt"]) == 1536]
    assert len(long) == 2 and long[0]["prompt"] != long[1]["prompt"]
    assert all(b["ignore_eos"] and b["max_tokens"] == 64 and b["stream"] for b in long)
    assert set(facts.describe()) >= {"prefill_tok_s", "decode_tok_s", "model"}


async def test_reset_retries_until_success_and_says_when_the_route_is_missing(
    http: aiohttp.ClientSession,
) -> None:
    fake = FakeVllm([{"success": False}, {"success": True}])
    server = await start_local(fake.app())
    try:
        assert await reset_prefix_cache(http, server.url, timeout_s=10) is True
        assert fake.resets == 2
        fake.reset_answers = [{"success": False}]
        assert await reset_prefix_cache(http, server.url, timeout_s=0) is False
        fake.reset_answers = [404]
        assert await reset_prefix_cache(http, server.url) is None
        fake.reset_answers = [200]  # an older server: empty 200
        assert await reset_prefix_cache(http, server.url) is True
    finally:
        await server.stop()
