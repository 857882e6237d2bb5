"""The emulator over real sockets: OpenAI routes, SSE framing, usage, errors, disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from marsproxy.emulator.server import RUNNER_KEY
from marsproxy.emulator.tokenizer import encode_chat, filler_text

from .sse_events import key_shape, openai_frames, post

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MODEL = "tiny-emulated"
StartEmulator = Callable[..., Awaitable[TestServer]]


async def test_chat_non_streaming(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator()
    messages = [{"role": "user", "content": "Say hello."}]
    status, body = await post(
        http,
        server,
        "/v1/chat/completions",
        {"model": MODEL, "messages": messages, "max_tokens": 7, "ignore_eos": True, "foo": 1},
    )
    assert status == 200
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == filler_text(0, 7)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(encode_chat(messages))
    assert body["usage"]["completion_tokens"] == 7
    # As vLLM 0.32 with --enable-prompt-tokens-details: {"cached_tokens": 0,
    # "created_cache_tokens": 0, "multimodal_tokens": null} for a 16-token prompt.
    assert body["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0, "created_cache_tokens": 0, "multimodal_tokens": None}
    real = FIXTURES / "vllm-0.32-chat.json"
    if real.exists():  # same keys as a real vLLM 0.32 answer (plus prompt_tokens_details)
        want = key_shape(json.loads(real.read_text()))
        want["usage"]["prompt_tokens_details"] = dict.fromkeys(
            ("cached_tokens", "created_cache_tokens", "multimodal_tokens"))
        assert key_shape(body) == want


async def test_chat_streaming_with_usage(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator()
    status, chunks = await post(
        http,
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Count."}],
            "max_completion_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]]
    assert "".join(content) == filler_text(0, 5) and len(content) == 5
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:-1]] == [None] * 4 + ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    real = FIXTURES / "vllm-0.32-chat-stream.txt"
    if real.exists():
        ref = openai_frames(real.read_text())
        assert key_shape(chunks[0]) == key_shape(ref[0])
        assert key_shape(chunks[1]) == key_shape(ref[1])
        assert key_shape(chunks[-2]) == key_shape(ref[-2])
        assert set(chunks[-1]) == set(ref[-1])


async def test_stream_without_usage_has_no_usage_chunk(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator()
    _, chunks = await post(
        http,
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True},
    )
    assert all(c["choices"] for c in chunks) and "usage" not in chunks[-1]


async def test_completions(start_emulator: StartEmulator, http: aiohttp.ClientSession) -> None:
    server = await start_emulator()
    status, body = await post(
        http, server, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4}
    )
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == filler_text(0, 4)
    assert body["usage"]["prompt_tokens"] == 3
    status, chunks = await post(
        http,
        server,
        "/v1/completions",
        {"prompt": "abcdefgh", "stream": True, "stream_options": {"include_usage": True}},
    )
    assert status == 200
    texts = [c["choices"][0]["text"] for c in chunks[:-1]]
    assert len(texts) == 16  # vLLM's default max_tokens for completions
    assert chunks[-1]["usage"]["prompt_tokens"] == 2
    real = FIXTURES / "vllm-0.32-completions-stream.txt"
    if real.exists():
        ref = openai_frames(real.read_text())
        assert key_shape(chunks[0]) == key_shape(ref[0])
        assert key_shape(chunks[-2]) == key_shape(ref[-2])
    # several prompts: a choice each (tests/integration/emulator/test_emulator_request_parity.py)
    status, body = await post(http, server, "/v1/completions", {"prompt": ["a", "b"]})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]


async def test_second_turn_reports_cached_tokens(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator()
    turn1 = [
        {"role": "system", "content": "You are a coding agent. " * 20},
        {"role": "user", "content": "Fix the failing test."},
    ]
    _, first = await post(
        http,
        server,
        "/v1/chat/completions",
        {"messages": turn1, "max_tokens": 30, "ignore_eos": True},
    )
    reply = first["choices"][0]["message"]["content"]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Tool output: 1 passed"},
    ]
    _, second = await post(
        http,
        server,
        "/v1/chat/completions",
        {
            "messages": turn2,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    cached = second[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    computed = first["usage"]["prompt_tokens"] + 30 - 1  # the last sampled token has no KV
    assert cached == computed // 16 * 16 and cached > first["usage"]["prompt_tokens"]


async def test_errors(start_emulator: StartEmulator, http: aiohttp.ClientSession) -> None:
    server = await start_emulator()
    status, body = await post(
        http,
        server,
        "/v1/chat/completions",
        {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
    )
    assert status == 404 and body["error"]["type"] == "NotFoundError"
    assert body["error"]["param"] == "model" and "gpt-4" in body["error"]["message"]
    async with http.post(server.make_url("/v1/chat/completions"), data=b"{not json") as resp:
        assert resp.status == 400
        err = await resp.json()
        assert err["error"]["code"] == 400 and set(err["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
    status, body = await post(http, server, "/v1/chat/completions", {"messages": "hi"})
    assert status == 400
    status, body = await post(
        http, server, "/v1/completions", {"prompt": list(range(9000)), "max_tokens": 1}
    )
    assert status == 400 and "maximum context length" in body["error"]["message"]
    # priority is accepted (and ignored) under fcfs, like vLLM
    status, _ = await post(
        http, server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "priority": -3}
    )
    assert status == 200


async def test_side_routes(start_emulator: StartEmulator, http: aiohttp.ClientSession) -> None:
    server = await start_emulator(served_model_name="my-model")
    async with http.get(server.make_url("/health")) as resp:
        assert resp.status == 200 and await resp.read() == b""
    async with http.get(server.make_url("/ping")) as resp:
        assert resp.status == 200
    async with http.get(server.make_url("/version")) as resp:
        assert (await resp.json())["version"] == "0.32.0"
    async with http.get(server.make_url("/v1/models")) as resp:
        models = await resp.json()
        assert [m["id"] for m in models["data"]] == ["my-model"]
        real = FIXTURES / "vllm-0.32-models.json"
        if real.exists():
            assert key_shape(models) == key_shape(json.loads(real.read_text()))
    status, tok = await post(
        http, server, "/tokenize", {"model": "my-model", "prompt": "abcdefghi"}
    )
    assert status == 200 and tok["count"] == 3 and len(tok["tokens"]) == 3
    msgs = [{"role": "user", "content": "hello"}]
    status, tok = await post(http, server, "/tokenize", {"messages": msgs})
    assert tok["tokens"] == encode_chat(msgs)


async def test_max_model_len_as_vllms_flag(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator(max_model_len=2048)
    async with http.get(server.make_url("/v1/models")) as resp:
        assert (await resp.json())["data"][0]["max_model_len"] == 2048
    status, body = await post(
        http, server, "/v1/completions", {"prompt": list(range(2049)), "max_tokens": 1}
    )
    assert status == 400 and "maximum context length is 2048" in body["error"]["message"]
    status, body = await post(
        http, server, "/v1/completions", {"prompt": list(range(2000)), "max_tokens": 1}
    )
    assert status == 200 and body["usage"]["prompt_tokens"] == 2000


async def _wait_until(cond: Any, within: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not cond():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_stream_disconnect_aborts_request(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator(time_scale=5.0)  # slow: the request is surely still running
    engine = server.app[RUNNER_KEY].engine
    resp = await http.post(
        server.make_url("/v1/chat/completions"),
        json={
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        },
    )
    line = await resp.content.readline()
    rid = json.loads(line[len(b"data: ") :])["id"]
    assert engine.has_request(rid) and engine.kv.usage > 0
    resp.close()  # drop the connection mid-stream
    await _wait_until(lambda: not engine.has_request(rid))
    assert engine.kv.usage == 0.0 and not engine.has_work()


async def test_non_streaming_disconnect_aborts_request(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator(time_scale=5.0)
    engine = server.app[RUNNER_KEY].engine
    task = asyncio.create_task(
        post(
            http,
            server,
            "/v1/completions",
            {"prompt": "go", "max_tokens": 2000, "ignore_eos": True},
        )
    )
    await _wait_until(lambda: engine.has_work())
    task.cancel()
    await _wait_until(lambda: not engine.has_work())
    assert engine.kv.usage == 0.0


async def test_priority_policy_over_http(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator(scheduling_policy="priority", max_num_seqs=1, time_scale=2.0)
    engine = server.app[RUNNER_KEY].engine
    order: list[str] = []

    async def call(name: str, priority: int, max_tokens: int) -> None:
        body = {"prompt": name, "max_tokens": max_tokens, "ignore_eos": True, "priority": priority}
        status, _ = await post(http, server, "/v1/completions", body)
        assert status == 200
        order.append(name)

    first = asyncio.create_task(call("blocker", 9, 200))
    await _wait_until(lambda: engine.stats().running == 1)
    late = asyncio.create_task(call("low", 5, 2))
    await _wait_until(lambda: engine.stats().waiting == 1)
    early = asyncio.create_task(call("high", 0, 2))
    await _wait_until(lambda: engine.stats().waiting == 2)
    await asyncio.gather(first, late, early)
    # The running request is not preempted; then the lower priority value goes first.
    assert order == ["blocker", "high", "low"]


async def test_unknown_route_and_wrong_method_answer_as_vllm(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # vLLM's server is FastAPI over Starlette: no route → 404 {"detail":"Not Found"}; a route
    # with another method → 405 {"detail":"Method Not Allowed"} with an allow header. Both
    # compact JSON, application/json (Starlette's JSONResponse).
    server = await start_emulator()
    for method, path in (("GET", "/no/such/route"), ("POST", "/sleep"), ("DELETE", "/v2/x")):
        async with http.request(method, server.make_url(path)) as resp:
            assert resp.status == 404, path
            assert resp.content_type == "application/json"
            assert await resp.read() == b'{"detail":"Not Found"}'
    for method, path, allow in (
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions", "POST"),
        ("POST", "/v1/models", "GET, HEAD"),
        ("DELETE", "/ping", "GET, HEAD, POST"),
    ):
        async with http.request(method, server.make_url(path), data=b"{}") as resp:
            assert resp.status == 405, path
            assert resp.content_type == "application/json"
            assert resp.headers["Allow"] == allow
            assert await resp.read() == b'{"detail":"Method Not Allowed"}'
    # Served routes are untouched by the catch-all.
    async with http.get(server.make_url("/v1/models")) as resp:
        assert resp.status == 200 and (await resp.json())["object"] == "list"
