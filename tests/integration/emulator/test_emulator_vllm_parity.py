"""Edge cases of the OpenAI routes against what a real vLLM 0.32.0 answered.

Observed on 2026-12 with ``scripts/real-vllm/start.sh`` (tiny model, ``--max-model-len 4096``,
block size 32, ``--enable-prompt-tokens-details``) and the same requests sent to the emulator
(``--max-model-len 4096``); the real answers are quoted in each test. Output text and timing
differ by design and are not compared.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from marsproxy.emulator.tokenizer import encode_chat, encode_text, filler_text

from .sse_events import openai_frames, post

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
StartEmulator = Callable[..., Awaitable[TestServer]]
MESSAGES = [{"role": "user", "content": "Say hello."}]


def _keys(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _keys(v) for k, v in obj.items()}
    return None


async def test_usage_details_are_keyed_as_vllms(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # Real: chat {"cached_tokens": 0, "created_cache_tokens": 192, "multimodal_tokens": null} for
    # a cold 211-token prompt, then {"cached_tokens": 192, "created_cache_tokens": 0, ...};
    # completions {"cached_tokens": 0, "created_cache_tokens": null, "multimodal_tokens": null};
    # streamed (the choices: [] chunk) chat {"cached_tokens", "created_cache_tokens"},
    # completions {"cached_tokens"} only.
    server = await start_emulator()
    long = [{"role": "user", "content": "hello world " * 40}]
    n = len(encode_chat(long))
    _, cold = await post(http, server, "/v1/chat/completions",
                          {"messages": long, "max_tokens": 2})
    _, warm = await post(http, server, "/v1/chat/completions",
                          {"messages": long, "max_tokens": 2})
    assert cold["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0, "created_cache_tokens": n // 16 * 16, "multimodal_tokens": None}
    assert warm["usage"]["prompt_tokens_details"] == {
        "cached_tokens": n // 16 * 16, "created_cache_tokens": 0, "multimodal_tokens": None}
    _, cmpl = await post(http, server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert cmpl["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0, "created_cache_tokens": None, "multimodal_tokens": None}
    stream = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 2}
    _, chunks = await post(http, server, "/v1/chat/completions", {"messages": long, **stream})
    assert set(chunks[-1]["usage"]["prompt_tokens_details"]) == {
        "cached_tokens", "created_cache_tokens"}
    _, chunks = await post(http, server, "/v1/completions", {"prompt": "hi", **stream})
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_continuous_usage_stats(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # Real: with include_usage + continuous_usage_stats every chunk carries the usage so far
    # (tests/fixtures/vllm-0.32-chat-stream-continuous-usage.txt; completions chunks without
    # completion_tokens_details); continuous_usage_stats alone changes nothing.
    server = await start_emulator()
    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, "stream": True,
            "stream_options": opts}
    _, chunks = await post(http, server, "/v1/chat/completions", body)
    p = len(encode_chat(MESSAGES))
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == p for c in chunks)
    ref = openai_frames((FIXTURES / "vllm-0.32-chat-stream-continuous-usage.txt").read_text())
    assert [_keys(c) for c in chunks[:-1]] == [_keys(c) for c in ref[:-1]]
    assert list(chunks[0]) == list(ref[0])  # usage before prompt_token_ids, as vLLM's
    _, chunks = await post(http, server, "/v1/completions", {
        "prompt": "hello", "max_tokens": 2, "ignore_eos": True, "stream": True,
        "stream_options": opts})
    assert [c["usage"] for c in chunks[:-1]] == [
        {"prompt_tokens": 2, "total_tokens": 3, "completion_tokens": 1},
        {"prompt_tokens": 2, "total_tokens": 4, "completion_tokens": 2}]
    _, chunks = await post(http, server, "/v1/chat/completions", {
        **body, "stream_options": {"continuous_usage_stats": True}})
    assert not any("usage" in c for c in chunks)


async def test_last_chunk_without_usage_carries_the_fingerprint(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # Real (tests/fixtures/vllm-0.32-chat-stream-no-usage.txt): without include_usage the
    # finish_reason chunk ends with "system_fingerprint"; with it, only the usage chunk has it.
    server = await start_emulator()
    body = {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, "stream": True}
    _, chunks = await post(http, server, "/v1/chat/completions", body)
    ref = openai_frames((FIXTURES / "vllm-0.32-chat-stream-no-usage.txt").read_text())
    assert [list(c) for c in chunks] == [list(c) for c in ref]
    _, chunks = await post(http, server, "/v1/completions",
                            {"prompt": "hi", "max_tokens": 2, "stream": True})
    assert "system_fingerprint" in chunks[-1] and "system_fingerprint" not in chunks[0]


async def test_max_tokens_limits_and_defaults(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator(max_model_len=4096)
    # Real: {"message": "max_tokens=5000 cannot be greater than max_model_len=4096. Please
    # request fewer output tokens. (parameter=max_tokens, value=5000)", "type":
    # "BadRequestError", "param": "max_tokens", "code": 400}, also for a too-long prompt.
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}),
                       ("/v1/completions", {"prompt": [5] * 4200})):
        status, err = await post(http, server, path, {**body, "max_tokens": 5000})
        assert status == 400 and err["error"] == {
            "message": "max_tokens=5000 cannot be greater than max_model_len=4096. Please "
                       "request fewer output tokens. (parameter=max_tokens, value=5000)",
            "type": "BadRequestError", "param": "max_tokens", "code": 400}
    status, err = await post(http, server, "/v1/chat/completions",
                              {"messages": MESSAGES, "max_completion_tokens": 5000})
    assert status == 400 and err["error"]["param"] == "max_completion_tokens"
    assert err["error"]["message"].startswith("max_completion_tokens=5000 cannot be greater")
    # Real: max_tokens 4096 with a 2-token prompt is cut to the room (200).
    status, _ = await post(http, server, "/v1/completions",
                            {"prompt": [5, 6], "max_tokens": 4096})
    assert status == 200
    # Real: "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)".
    status, err = await post(http, server, "/v1/chat/completions",
                              {"messages": MESSAGES, "max_completion_tokens": 0})
    assert status == 400 and err["error"]["message"] == (
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)")
    # Real: completions with "max_tokens": null generate vLLM's default 16.
    status, body = await post(http, server, "/v1/completions",
                               {"prompt": "hi", "max_tokens": None, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 16


async def test_prompt_over_the_context(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator(max_model_len=4096)
    # Token ids: the captured answer, exactly.
    status, err = await post(http, server, "/v1/completions",
                              {"prompt": [5] * 4200, "max_tokens": 10})
    assert status == 400
    assert err == json.loads((FIXTURES / "vllm-0.32-error-400-context.json").read_text())
    # Text (chat, a string prompt, Messages) is tokenized up to max_model_len + 1. Real: "...
    # your prompt contains at least 4097 input tokens, ... (parameter=input_tokens,
    # value=4097)"; Messages the same message in the Anthropic shape.
    at_least = ("This model's maximum context length is 4096 tokens. However, your prompt "
                "contains at least 4097 input tokens, which exceeds this limit even without any"
                " output tokens. Please reduce the length of the input prompt. "
                "(parameter=input_tokens, value=4097)")
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab " * 9000}]}),
        ("/v1/completions", {"prompt": "ab " * 9000}),
    ):
        status, err = await post(http, server, path, {**body, "max_tokens": 5})
        assert status == 400 and err["error"]["message"] == at_least
        assert err["error"]["param"] == "input_tokens"
    status, err = await post(http, server, "/v1/messages", {
        "model": "tiny-emulated", "max_tokens": 5,
        "messages": [{"role": "user", "content": "ab " * 9000}]})
    assert status == 400 and err == {
        "type": "error", "error": {"type": "BadRequestError", "message": at_least}}
    # Real: a prompt of exactly max_model_len ids leaves max_tokens 0.
    status, err = await post(http, server, "/v1/completions",
                              {"prompt": [5] * 4096, "max_tokens": 1})
    assert status == 400 and err["error"]["param"] == "max_tokens"
    assert err["error"]["message"].startswith("max_tokens must be at least 1, got 0.")


async def test_stream_options_need_stream(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # Real: {"message": "Stream options can only be defined when `stream=True`.
    # (parameter=stream_options)", "type": "BadRequestError", "param": "stream_options"}, before
    # the model is looked up; an empty or null stream_options is fine.
    server = await start_emulator()
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}),
                       ("/v1/completions", {"prompt": "hi", "model": "nope"})):
        status, err = await post(http, server, path, {
            **body, "max_tokens": 2, "stream_options": {"include_usage": True}})
        assert status == 400 and err["error"] == {
            "message": "Stream options can only be defined when `stream=True`. "
                       "(parameter=stream_options)",
            "type": "BadRequestError", "param": "stream_options", "code": 400}
    for opts in (None, {}):
        status, _ = await post(http, server, "/v1/chat/completions", {
            "messages": MESSAGES, "max_tokens": 2, "stream": False, "stream_options": opts})
        assert status == 200


async def test_completions_echo(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # Real: "echo": true prefixes the text with the prompt ("hi" + output); streamed, the first
    # chunk's text starts with the prompt and carries "prompt_token_ids" (the prompt's ids).
    server = await start_emulator()
    _, body = await post(http, server, "/v1/completions",
                          {"prompt": "hi", "max_tokens": 2, "echo": True, "ignore_eos": True})
    assert body["choices"][0]["text"] == "hi" + filler_text(0, 2)
    assert body["usage"]["prompt_tokens"] == 1 and body["usage"]["completion_tokens"] == 2
    _, chunks = await post(http, server, "/v1/completions", {
        "prompt": ["hi"], "max_tokens": 2, "echo": True, "stream": True, "ignore_eos": True})
    assert [c["choices"][0]["text"] for c in chunks] == ["hi" + filler_text(0, 1),
                                                        filler_text(1, 1)]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == encode_text("hi")
    assert chunks[1]["choices"][0]["prompt_token_ids"] is None


async def test_booleans_are_read_as_pydantic_lax_mode_reads_them(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # Not an observed answer: vLLM's request models are pydantic models in lax mode, so a
    # bool field takes "true"/"yes"/"on"/"t"/"y"/"1" (any case), 1 and 1.0 (false alike); any
    # other value is FastAPI's 400 naming the field (type "Bad Request", param "body.stream").
    server = await start_emulator()
    for flag in ("true", "YES", "on", "t", "y", "1", 1, 1.0):
        status, chunks = await post(http, server, "/v1/chat/completions", {
            "messages": MESSAGES, "max_tokens": 2, "stream": flag,
            "stream_options": {"include_usage": flag}})
        assert status == 200 and chunks[-1]["usage"]["completion_tokens"] == 2, flag
    status, body = await post(http, server, "/v1/completions", {
        "prompt": "hi", "max_tokens": 2, "stream": "off", "echo": "True", "ignore_eos": "1"})
    assert status == 200 and body["choices"][0]["text"] == "hi" + filler_text(0, 2)
    for flag in ("maybe", " true", "", 2, 0.5, [], {}):
        status, err = await post(http, server, "/v1/chat/completions", {
            "messages": MESSAGES, "max_tokens": 2, "stream": flag})
        assert status == 400 and err["error"]["param"] == "body.stream", flag
        assert err["error"]["type"] == "Bad Request", flag
    async with http.post(server.make_url("/v1/messages"), json={
            "model": "tiny-emulated", "max_tokens": 2, "messages": MESSAGES,
            "stream": "true"}) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        assert "event: message_stop" in await r.text()
