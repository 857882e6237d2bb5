"""Request fields and their validation against vLLM 0.32.0's.

Where a test cites "source", the answer is read from vLLM 0.32.0's own code (the wheel's
``entrypoints/openai/*/protocol.py``, ``sampling_params.py``, ``serve/exception_handling``);
"observed" answers are quoted from tests/fixtures/README.md. Output text is not compared.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from marsproxy.emulator.server import RUNNER_KEY
from marsproxy.emulator.tokenizer import encode_chat, encode_text, filler_text

from .sse_events import post

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
StartEmulator = Callable[..., Awaitable[TestServer]]
MESSAGES = [{"role": "user", "content": "Say hello."}]
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"


def _pydantic(errors: list[dict[str, Any]]) -> str:
    """FastAPI's validation message as vLLM words it."""
    label = "error" if len(errors) == 1 else "errors"
    return f"{len(errors)} validation {label}:\n" + "\n".join(f"  {e}" for e in errors)


async def test_fields_are_typed_as_vllms_request_models(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # Source: the request models are pydantic models in lax mode behind FastAPI: a number in a
    # string or an integral float is read as the number; a field of the wrong type is FastAPI's
    # 400 "Bad Request", param "body.<field>". Observed: "priority": "high" and 1.5 are 400s
    # (int_parsing, int_from_float) with param "body.priority".
    server = await start_emulator()
    for max_tokens in ("3", 3.0):
        status, body = await post(http, server, CHAT, {
            "messages": MESSAGES, "max_tokens": max_tokens, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 3, max_tokens
    status, body = await post(http, server, CMPL, {
        "prompt": "hi", "max_tokens": 2, "temperature": "0.5", "seed": "7", "n": 1.0,
        "some_unknown_field": {"x": 1}})
    assert status == 200 and body["usage"]["completion_tokens"] <= 2
    status, err = await post(http, server, CMPL, {"prompt": "hi", "priority": "high"})
    assert status == 400 and err["error"] == {
        "message": _pydantic([{"type": "int_parsing", "loc": "body.priority",
                               "msg": "Input should be a valid integer, unable to parse "
                                      "string as an integer", "input": "high"}]),
        "type": "Bad Request", "param": "body.priority", "code": 400}
    status, err = await post(http, server, CMPL, {"prompt": "hi", "priority": 1.5})
    assert status == 400 and "'type': 'int_from_float'" in err["error"]["message"]
    assert err["error"]["param"] == "body.priority"
    status, err = await post(http, server, CHAT, {"model": "tiny-emulated", "max_tokens": 5})
    assert status == 400 and err["error"] == {
        "message": _pydantic([{"type": "missing", "loc": "body.messages",
                               "msg": "Field required", "input": "<dict of 2 items>"}]),
        "type": "Bad Request", "param": "body.messages", "code": 400}
    # Several fields wrong: every error, the first one's location as param.
    status, err = await post(http, server, CHAT, {
        "messages": MESSAGES, "temperature": "hot", "stop": ["a", "b", "c", "d", "e"]})
    assert status == 400 and err["error"]["type"] == "Bad Request"
    assert err["error"]["param"] == "body.stop"
    message = err["error"]["message"]
    # stop is "str | list[str] (at most 4) | None": an error per branch, in field order
    assert message.startswith(
        "3 validation errors:\n  {'type': 'string_type', 'loc': 'body.stop'")
    assert message.index("'too_long', 'loc': 'body.stop'") < message.index(
        "'float_parsing', 'loc': 'body.temperature'")


async def test_malformed_json_answers_as_fastapi(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # Observed: the fixture's truncated body gives json_invalid at its offset.
    server = await start_emulator(served_model_name="tiny")
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}'
    async with http.post(server.make_url(CHAT), data=raw,
                         headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
        assert await resp.json() == json.loads(
            (FIXTURES / "vllm-0.32-error-400.json").read_text())


async def test_content_type_must_be_json(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # Source: every POST route depends on validate_json_request, which raises FastAPI's
    # RequestValidationError(["Unsupported Media Type: ..."]) unless the media type is
    # application/json; observed for /v1/messages ("a content-type other than
    # application/json" is a 400 "Bad Request").
    server = await start_emulator()
    body = json.dumps({"messages": MESSAGES, "max_tokens": 2}).encode()
    for path in (CHAT, CMPL, "/v1/messages", "/tokenize"):
        async with http.post(server.make_url(path), data=body,
                             headers={"Content-Type": "text/plain"}) as resp:
            assert resp.status == 400, path
            assert (await resp.json())["error"] == {
                "message": "1 validation error:\n  Unsupported Media Type: Only "
                           "'application/json' is allowed",
                "type": "Bad Request", "param": None, "code": 400}
    async with http.post(server.make_url(CHAT), data=body, headers={
            "Content-Type": "application/json; charset=utf-8"}) as resp:
        assert resp.status == 200


async def test_sampling_parameters_out_of_range(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # Source: SamplingParams._verify_args (a VLLMValidationError: 400 "BadRequestError"; the
    # "(parameter=..., value=...)" suffix only where it names one), checked after the model
    # and the prompt.
    server = await start_emulator(max_model_len=4096)
    cases: list[tuple[dict[str, Any], str, str | None]] = [
        ({"temperature": 3}, "temperature must be in [0, 2], got 3.0. "
                             "(parameter=temperature, value=3.0)", "temperature"),
        ({"temperature": -0.5}, "temperature must be non-negative, got -0.5. "
                                "(parameter=temperature, value=-0.5)", "temperature"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)",
         "top_p"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5.", None),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3.0.", None),
        ({"n": 0}, "n must be at least 1, got 0.", None),
        ({"n": 2, "temperature": 0}, "n must be 1 when using greedy sampling, got 2.", None),
        ({"stop": ["ok", ""]}, "stop cannot contain an empty string.", None),
        ({"min_tokens": 9, "max_tokens": 3},
         "min_tokens must be less than or equal to max_tokens=3, got 9.", None),
    ]
    for path, body in ((CHAT, {"messages": MESSAGES}), (CMPL, {"prompt": "hi"})):
        for extra, message, param in cases:
            status, err = await post(http, server, path, {**body, **extra})
            assert status == 400 and err["error"] == {
                "message": message, "type": "BadRequestError", "param": param,
                "code": 400}, (path, extra)
    # The model and the prompt's length are checked first.
    status, err = await post(http, server, CHAT, {
        "messages": MESSAGES, "temperature": 9, "model": "nope"})
    assert status == 404
    status, err = await post(http, server, CMPL, {"prompt": [5] * 4200, "temperature": 9})
    assert status == 400 and err["error"]["param"] == "input_tokens"


async def test_logprobs_and_response_format_checks(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # Source: the request models' check_logprobs and validate_response_format validators.
    server = await start_emulator()
    cases: list[tuple[str, dict[str, Any], str, str]] = [
        (CHAT, {"top_logprobs": 5}, "when using `top_logprobs`, `logprobs` must be set to "
                                    "true. (parameter=top_logprobs)", "top_logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": -2}, "`top_logprobs` must be a positive "
         "value or -1. (parameter=top_logprobs, value=-2)", "top_logprobs"),
        (CMPL, {"logprobs": -3}, "`logprobs` must be a positive value or -1. "
                                 "(parameter=logprobs, value=-3)", "logprobs"),
        (CHAT, {"response_format": {"type": "json_schema"}}, "When response_format type is "
         "'json_schema', the 'json_schema' field must be provided. "
         "(parameter=response_format)", "response_format"),
    ]
    for path, extra, message, param in cases:
        body = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
        status, err = await post(http, server, path, {**body, **extra})
        assert status == 400 and err["error"] == {
            "message": message, "type": "BadRequestError", "param": param, "code": 400}, extra
    status, _ = await post(http, server, CHAT, {
        "messages": MESSAGES, "max_tokens": 2, "response_format": {"type": "json_object"}})
    assert status == 200


async def test_prompts_and_messages_that_are_missing_or_empty(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator()
    # Source: CompletionRequest.validate_prompt_and_prompt_embeds.
    for body in ({}, {"prompt": ""}, {"prompt": None}):
        status, err = await post(http, server, CMPL, {**body, "max_tokens": 2})
        assert status == 400 and err["error"] == {
            "message": "Either prompt or prompt_embeds must be provided and non-empty. "
                       "(parameter=prompt)",
            "type": "BadRequestError", "param": "prompt", "code": 400}, body
    # Observed (through /v1/messages, which renders the same chat request): the chat
    # template's refusal of an empty conversation.
    status, err = await post(http, server, CHAT, {"messages": [], "max_tokens": 2})
    assert status == 400 and err["error"] == {
        "message": "Cannot apply chat template to an empty conversation. Provide at least one "
                   "message.", "type": "BadRequestError", "param": None, "code": 400}
    # Observed: "Token id 99999 is out of vocabulary" (the largest id; the emulated vocabulary
    # is 151,936).
    status, err = await post(http, server, CMPL, {"prompt": [5, 999_999, 151_936]})
    assert status == 400 and err["error"] == {
        "message": "Token id 999999 is out of vocabulary", "type": "BadRequestError",
        "param": None, "code": 400}


async def test_n_choices(start_emulator: StartEmulator, http: aiohttp.ClientSession) -> None:
    # Source: vLLM's chat serving (full and stream generators) runs n sequences of the prompt:
    # choices numbered 0..n-1, usage counts the prompt once and the tokens of all; streamed,
    # each choice's role chunk first, its chunks with its index, its own finish chunk (with the
    # fingerprint when no usage chunk follows), then one usage chunk summing all.
    server = await start_emulator()
    p = len(encode_chat(MESSAGES))
    base = {"messages": MESSAGES, "max_tokens": 2, "ignore_eos": True}
    status, body = await post(http, server, CHAT, {**base, "n": 3})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == filler_text(0, 2) for c in body["choices"])
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == p and body["usage"]["completion_tokens"] == 6
    assert body["usage"]["total_tokens"] == p + 6
    status, chunks = await post(http, server, CHAT, {
        **base, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""}] * 2
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[2:-1] if c["choices"][0]["index"] == index]
        assert "".join(c["delta"]["content"] for c in mine) == filler_text(0, 2)
        assert [c["finish_reason"] for c in mine] == [None, "length"]
    assert not any("system_fingerprint" in c for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-1]["usage"]["prompt_tokens"] == p
    status, chunks = await post(http, server, CHAT, {**base, "n": 2, "stream": True})
    finals = [c for c in chunks if c["choices"][0]["finish_reason"] is not None]
    assert sorted(c["choices"][0]["index"] for c in finals) == [0, 1]
    assert all("system_fingerprint" in c for c in finals)
    engine = server.app[RUNNER_KEY].engine
    assert not engine.has_work() and engine.kv.usage == 0.0


async def test_several_completion_prompts(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    # Source: vLLM's completions serving runs every prompt of a list (strings or token-id
    # lists) with n choices each, choice index prompt × n + sample; usage sums the prompts.
    server = await start_emulator()
    base = {"max_tokens": 2, "ignore_eos": True}
    status, body = await post(http, server, CMPL, {
        **base, "prompt": ["hello", "abcdefghij"], "n": 2, "echo": True})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [
        "hello" + filler_text(0, 2)] * 2 + ["abcdefghij" + filler_text(0, 2)] * 2
    assert body["usage"]["prompt_tokens"] == len(encode_text("hello")) + 3
    assert body["usage"]["completion_tokens"] == 8
    status, chunks = await post(http, server, CMPL, {
        **base, "prompt": [[5, 6], [7, 8, 9]], "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert status == 200
    for index, prompt in ((0, 2), (1, 3)):
        mine = [c for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert [c["usage"] for c in mine] == [
            {"prompt_tokens": prompt, "total_tokens": prompt + k, "completion_tokens": k}
            for k in (1, 2)]
    assert chunks[-1]["usage"]["prompt_tokens"] == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    # Each prompt's length is checked (the second here).
    status, err = await post(http, server, CMPL, {**base, "prompt": [[5], [5] * 9000]})
    assert status == 400 and err["error"]["param"] == "input_tokens"


async def test_load_route(start_emulator: StartEmulator, http: aiohttp.ClientSession) -> None:
    # Observed: GET /load → {"server_load": N}, N the requests in flight (0 when idle).
    server = await start_emulator(time_scale=5.0)  # slow: the request is surely still running
    async with http.get(server.make_url("/load")) as resp:
        assert resp.status == 200 and await resp.json() == {"server_load": 0}
    resp = await http.post(server.make_url(CHAT), json={
        "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "stream": True})
    await resp.content.readline()
    async with http.get(server.make_url("/load")) as r:
        assert await r.json() == {"server_load": 1}
    resp.close()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while server.app[RUNNER_KEY].server_load:
        assert loop.time() < deadline, "the load did not drop"
        await asyncio.sleep(0.02)
    async with http.get(server.make_url("/load")) as r:
        assert await r.json() == {"server_load": 0}
