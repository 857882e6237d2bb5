"""The emulator's ``/v1/messages`` over real sockets, against the shapes real vLLM 0.32 sent
(``tests/fixtures/vllm-0.32-messages*``): body and event keys, event order, usage with the
cache split, the prefix cache shared with the chat route, and both error shapes."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from marsproxy.emulator.tokenizer import filler_text

from .sse_events import anthropic_events, key_shape

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MODEL = "tiny-emulated"
StartEmulator = Callable[..., Awaitable[TestServer]]
SYSTEM = "You are a careful coding agent. " * 10
BODY = {"model": MODEL, "max_tokens": 5, "system": [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=1f2e;"},
    {"type": "text", "text": SYSTEM}], "messages": [{"role": "user", "content": "Say hello."}]}


async def _post(http: aiohttp.ClientSession, server: TestServer, body: Any,
                path: str = "/v1/messages") -> tuple[int, str, str]:
    async with http.post(server.make_url(path), json=body) as r:
        return r.status, r.content_type, await r.text()


async def test_non_streaming_matches_vllm(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator()
    real = json.loads((FIXTURES / "vllm-0.32-messages.json").read_text())
    status, ctype, text = await _post(http, server, BODY)
    assert (status, ctype) == (200, "application/json")
    cold = json.loads(text)
    assert key_shape(cold) == key_shape(real) and list(cold) == list(real)
    assert list(cold["usage"]) == list(real["usage"])
    assert cold["content"] == [{"type": "text", "text": filler_text(0, 5)}]
    assert cold["stop_reason"] == "max_tokens" and cold["id"].startswith("chatcmpl-")
    u = cold["usage"]
    assert u["cache_read_input_tokens"] == 0 and u["cache_creation_input_tokens"] > 0
    warm = json.loads((await _post(http, server, BODY))[2])["usage"]
    # The same prompt again: what the first call wrote is read now; the split adds up the same.
    assert warm["cache_read_input_tokens"] == u["cache_creation_input_tokens"]
    assert warm["cache_creation_input_tokens"] == 0
    assert sum(warm[k] for k in ("input_tokens", "cache_read_input_tokens")) == sum(
        u[k] for k in ("input_tokens", "cache_creation_input_tokens"))


async def test_streaming_matches_vllm(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator()
    real = anthropic_events((FIXTURES / "vllm-0.32-messages-stream.txt").read_text())
    status, ctype, text = await _post(http, server, {**BODY, "stream": True})
    assert (status, ctype) == (200, "text/event-stream")
    mine = anthropic_events(text)
    names = [n for n, _ in mine]
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * 5,
                     "content_block_stop", "message_delta", "message_stop"]
    real_by_name = {n: o for n, o in real}
    for name, obj in mine:
        assert key_shape(obj) == key_shape(real_by_name[name]), name
        assert list(obj) == list(real_by_name[name]), name
    assert "".join(o["delta"]["text"] for n, o in mine if n == "content_block_delta") == (
        filler_text(0, 5))
    start, delta = mine[0][1], mine[-2][1]
    u = delta["usage"]
    prompt = u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]
    assert start["message"]["usage"] == {"input_tokens": prompt, "output_tokens": 0}
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert u["output_tokens"] == 5


async def test_a_messages_history_shares_the_chat_routes_prefix_cache(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # vLLM renders a Messages request as the equivalent chat request: same prompt, same cache.
    server = await start_emulator()
    chat = {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}]}
    async with http.post(server.make_url("/v1/chat/completions"), json=chat) as r:
        prompt = (await r.json())["usage"]["prompt_tokens"]
    u = json.loads((await _post(http, server, BODY))[2])["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] + u[
        "cache_creation_input_tokens"] == prompt
    assert u["cache_read_input_tokens"] == prompt // 16 * 16  # every full block of the chat's
    status, _, text = await _post(http, server, {k: v for k, v in BODY.items()
                                                 if k != "max_tokens"}, "/v1/messages/count_tokens")
    assert status == 200
    assert json.loads(text) == {"input_tokens": prompt,
                                "context_management": {"original_input_tokens": prompt}}


async def test_errors_in_both_of_vllms_shapes(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator()
    real_400 = json.loads((FIXTURES / "vllm-0.32-messages-error-400.json").read_text())
    real_404 = json.loads((FIXTURES / "vllm-0.32-messages-error-404.json").read_text())
    no_max = {k: v for k, v in BODY.items() if k != "max_tokens"}
    status, _, text = await _post(http, server, no_max)
    body = json.loads(text)
    assert status == 400 and key_shape(body) == key_shape(real_400)
    assert body["error"]["param"] == "body.max_tokens" and body["error"]["type"] == "Bad Request"
    assert "'type': 'missing'" in body["error"]["message"]
    for bad, param in (({**BODY, "max_tokens": 0}, "body.max_tokens"),
                       ({**BODY, "messages": [{"role": "tool", "content": "x"}]},
                        "body.messages.0.role"),
                       ({**BODY, "messages": [{"role": "user", "content": [{"type": "x"}]}]},
                        "body.messages.0.content.0.type"),
                       ({**BODY, "stream": "maybe"}, "body.stream")):
        status, _, text = await _post(http, server, bad)
        assert (status, json.loads(text)["error"]["param"]) == (400, param)
    status, _, text = await _post(http, server, {**BODY, "model": "nope", "stream": True})
    body = json.loads(text)
    assert status == 404 and key_shape(body) == key_shape(real_404)
    assert body["error"]["message"] == f"The model `nope` does not exist. Valid aliases: {MODEL}."
    status, _, text = await _post(http, server, {"model": MODEL, "max_tokens": 2, "messages": []})
    assert status == 400 and json.loads(text)["error"]["type"] == "BadRequestError"
    long = {**BODY, "messages": [{"role": "user", "content": "word " * 20_000}]}
    status, _, text = await _post(http, server, long)
    assert status == 400 and json.loads(text)["type"] == "error"
