"""The emulator's ``/v1/responses`` over real sockets, against what real vLLM 0.32 sent
(``tests/fixtures/vllm-0.32-responses*``): the response object and its fields' order, the
event sequence, usage with its cache split, the prompt rendered from instructions, items and a
stored previous response, and the errors (an id the store does not hold is a 404)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from marsproxy.emulator.profiles import get_profile
from marsproxy.emulator.tokenizer import encode_chat, filler_text

from .sse_events import anthropic_events, key_shape

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MODEL = "tiny-emulated"
StartEmulator = Callable[..., Awaitable[TestServer]]
BODY = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 5, "temperature": 0}


def _fixture(name: str) -> Any:
    return json.loads((FIXTURES / f"vllm-0.32-{name}.json").read_text())


async def _post(http: aiohttp.ClientSession, server: TestServer,
                body: Any) -> tuple[int, str, str]:
    async with http.post(server.make_url("/v1/responses"), json=body) as r:
        return r.status, r.content_type, await r.text()


async def _ok(http: aiohttp.ClientSession, server: TestServer, body: Any) -> dict[str, Any]:
    status, _, text = await _post(http, server, body)
    assert status == 200, text
    return dict(json.loads(text))


async def test_non_streaming_matches_vllm(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator()
    real = _fixture("responses")
    status, ctype, text = await _post(http, server, BODY)
    assert (status, ctype) == (200, "application/json")
    mine = json.loads(text)
    assert key_shape(mine) == key_shape(real) and list(mine) == list(real)
    for k in ("usage", "incomplete_details"):
        assert list(mine[k]) == list(real[k])
    assert list(mine["output"][0]) == list(real["output"][0])
    assert mine["output"][0]["content"][0]["text"] == filler_text(0, 5)
    assert mine["id"].startswith("resp_") and mine["output"][0]["id"].startswith("msg_")
    assert (mine["status"], mine["max_output_tokens"], mine["tool_choice"]) == (
        "incomplete", 5, "none")
    u = mine["usage"]
    prompt = len(encode_chat([{"role": "user", "content": "Say hello."}]))
    assert (u["input_tokens"], u["output_tokens"], u["total_tokens"]) == (prompt, 5, prompt + 5)
    # Without max_output_tokens: the room left in the context, as vLLM reports it.
    big = await _ok(http, server, {**BODY, "max_output_tokens": None, "input": "hi"})
    room = get_profile("tiny").effective_max_model_len - big["usage"]["input_tokens"]
    assert big["max_output_tokens"] == room


async def test_streaming_matches_vllm(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator()
    real = anthropic_events((FIXTURES / "vllm-0.32-responses-stream.txt").read_text())
    status, ctype, text = await _post(http, server, {**BODY, "max_output_tokens": 3,
                                                      "stream": True})
    assert (status, ctype) == (200, "text/event-stream")
    mine = anthropic_events(text)
    names = [n for n, _ in mine]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 3,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert [o["sequence_number"] for _, o in mine] == list(range(len(mine)))
    real_by_name = {n: o for n, o in real}
    for name, obj in mine:
        assert key_shape(obj) == key_shape(real_by_name[name]), name
        assert list(obj) == list(real_by_name[name]), name
    by_name = dict(mine)
    said = "".join(o["delta"] for n, o in mine if n == "response.output_text.delta")
    assert said == by_name["response.output_text.done"]["text"] == filler_text(0, 3)
    done = by_name["response.completed"]["response"]
    assert done["usage"]["output_tokens"] == 3 and done["output"][0]["content"][0]["text"] == said
    assert by_name["response.created"]["response"]["usage"] is None


async def test_a_stored_response_continues_by_its_id_and_others_are_404(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator(responses_store=True)
    first = await _ok(http, server, BODY)
    said = first["output"][0]["content"][0]["text"]
    nxt = await _ok(http, server, {**BODY, "input": "Go on.",
                                   "previous_response_id": first["id"]})
    real = _fixture("responses-continued")
    assert list(nxt) == list(real) and nxt["previous_response_id"] == first["id"]
    # The prompt is the earlier conversation, then the new input; its prefix is cached.
    convo = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": said},
             {"role": "user", "content": "Go on."}]
    u = nxt["usage"]
    assert u["input_tokens"] == len(encode_chat(convo))
    assert u["input_tokens_details"]["cached_tokens"] > 0
    # Not kept: store false; never made here (another server's, or gone): vLLM's 404.
    unkept = await _ok(http, server, {**BODY, "store": False})
    for rid in (unkept["id"], "resp_elsewhere"):
        status, _, text = await _post(http, server, {**BODY, "previous_response_id": rid})
        assert status == 404
        err = json.loads(text)
        assert key_shape(err) == key_shape(_fixture("responses-error-404"))
        assert err["error"]["message"] == f"Response with id '{rid}' not found."
    # Kept as it was answered: retrieved by id; it is not running, so not cancelled.
    async with http.get(server.make_url(f"/v1/responses/{first['id']}")) as r:
        assert (r.status, await r.json()) == (200, first)
    async with http.post(server.make_url(f"/v1/responses/{first['id']}/cancel")) as r:
        err = (await r.json())["error"]
        assert (r.status, err["message"], err["param"]) == (
            400, "Cannot cancel a synchronous response.", "response_id")
    for rid in (unkept["id"], "resp_elsewhere"):
        for method, path in (("GET", f"/v1/responses/{rid}"),
                             ("POST", f"/v1/responses/{rid}/cancel")):
            async with http.request(method, server.make_url(path)) as r:
                assert r.status == 404
                assert key_shape(await r.json()) == key_shape(_fixture("responses-error-404"))
    # Without the store (vLLM's default) nothing is kept: every id is unknown.
    plain = await start_emulator()
    made = await _ok(http, plain, BODY)
    status, _, _ = await _post(http, plain, {**BODY, "previous_response_id": made["id"]})
    assert status == 404


async def test_instructions_and_items_render_as_vllm_renders_them(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator()
    items = await _ok(http, server, {**BODY, "instructions": "You are terse.", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                         "text": "Say hello."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                              "text": "Hi."}]},
        {"role": "user", "content": "Again."}]})
    assert list(items) == list(_fixture("responses-items"))
    assert items["instructions"] == "You are terse."
    assert items["usage"]["input_tokens"] == len(encode_chat([
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again."}]))
    # A tool call and its output: the assistant's tool_calls, then a tool message.
    call = {"type": "function_call", "call_id": "c1", "name": "run",
            "arguments": '{"command":"ls"}'}
    tool = {"type": "function", "name": "run", "parameters": {"type": "object"}}
    called = await _ok(http, server, {**BODY, "tools": [tool], "input": [
        {"type": "message", "role": "user", "content": "run ls"}, call,
        {"type": "function_call_output", "call_id": "c1", "output": "a.py"}]})
    assert called["usage"]["input_tokens"] == len(encode_chat([
        {"role": "user", "content": "run ls"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "run", "arguments": '{"command":"ls"}'}}]},
        {"role": "tool", "content": "a.py", "tool_call_id": "c1"}]))
    assert called["tool_choice"] == "auto" and called["tools"][0]["name"] == "run"
    assert called["tools"][0]["strict"] is None  # every field of vLLM's tool model


async def test_bad_requests_get_vllms_errors(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator(max_model_len=4096)
    status, _, text = await _post(http, server, {"model": MODEL})
    real = _fixture("responses-error-400")
    assert status == 400 and key_shape(json.loads(text)) == key_shape(real)
    err = json.loads(text)["error"]
    assert (err["type"], err["param"]) == (real["error"]["type"], real["error"]["param"])
    assert "'loc': 'body.input', 'msg': 'Field required'" in err["message"]
    cases = [
        ({**BODY, "model": "nope"}, 404, "model", "The model `nope` does not exist."),
        ({**BODY, "max_output_tokens": 5000}, 400, "max_output_tokens",
         "max_output_tokens=5000 cannot be greater than max_model_len=4096."),
        ({**BODY, "input": "word " * 5000}, 400, "input_tokens",
         "This model's maximum context length is 4096 tokens."),
        ({**BODY, "max_output_tokens": 0}, 400, "max_tokens", "max_tokens must be at least 1"),
        ({**BODY, "input": [{"type": "bogus"}]}, 400, "body.input",
         "Unsupported input item type: bogus"),
        ({**BODY, "background": True}, 400, "background",
         "does not support `store=True` and therefore does not support the background mode"),
    ]
    for body, code, param, message in cases:
        status, _, text = await _post(http, server, body)
        assert status == code, text
        err = json.loads(text)["error"]
        assert err["param"] == param, text
        assert message in err["message"], text


async def test_background_responses_are_queued_then_kept_or_cancelled_as_vllm(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """``background: true``: vLLM answers ``queued`` at once (no output, no usage), keeps it so
    until the engine is done, then keeps the finished response; a queued one is cancelled (kept
    ``cancelled``, the engine drops it), once: after that it is not running."""
    server = await start_emulator(responses_store=True)
    queued = await _ok(http, server, {**BODY, "background": True})
    real = _fixture("responses-background")
    assert list(queued) == list(real) and key_shape(queued) == key_shape(real)
    assert (queued["status"], queued["output"], queued["usage"]) == ("queued", [], None)
    for _ in range(200):  # bounded: 10 s
        async with http.get(server.make_url(f"/v1/responses/{queued['id']}")) as r:
            kept = await r.json()
        if kept["status"] != "queued":
            break
        await asyncio.sleep(0.05)
    assert kept["status"] == "incomplete" and kept["usage"]["output_tokens"] == 5
    assert kept["output"][0]["content"][0]["text"] == filler_text(0, 5)
    # A long one, cancelled while queued.
    long = await _ok(http, server, {**BODY, "background": True, "max_output_tokens": 3000})
    async with http.post(server.make_url(f"/v1/responses/{long['id']}/cancel")) as r:
        cancelled = await r.json()
        assert r.status == 200
    real = _fixture("responses-background-cancelled")
    assert list(cancelled) == list(real) and key_shape(cancelled) == key_shape(real)
    assert {**cancelled, "status": "queued"} == long and cancelled["status"] == "cancelled"
    async with http.get(server.make_url(f"/v1/responses/{long['id']}")) as r:
        assert (await r.json())["status"] == "cancelled"
    async with http.post(server.make_url(f"/v1/responses/{long['id']}/cancel")) as r:
        assert (r.status, (await r.json())["error"]["message"]) == (
            400, "Cannot cancel a synchronous response.")
    async with http.get(server.make_url("/metrics")) as r:
        metrics = await r.text()
    assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="' in metrics
    aborted = [line for line in metrics.splitlines()
               if line.startswith("vllm:request_success_total") and '"abort"' in line]
    assert aborted and aborted[0].endswith(" 1.0"), aborted
    # Continued, it renders its input and no output (it has none), as vLLM's stored output.
    nxt = await _ok(http, server, {**BODY, "input": "Go on.", "previous_response_id": long["id"]})
    convo = [{"role": "user", "content": "Say hello."}, {"role": "user", "content": "Go on."}]
    assert nxt["usage"]["input_tokens"] == len(encode_chat(convo))
    # Background needs the request's store too: vLLM's validator.
    status, _, text = await _post(http, server, {**BODY, "background": True, "store": False})
    real = _fixture("responses-error-background")
    assert (status, json.loads(text)) == (400, real)


TOOLS = [{"type": "function", "name": "run", "description": "Run a shell command",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                         "required": ["command"]}}]
NAMED = {"type": "function", "name": "run"}


async def test_a_forced_function_call_matches_vllm(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """A named ``tool_choice`` answers one ``function_call`` item, whole and streamed, in the
    shapes a real vLLM 0.32 sent (``vllm-0.32-responses-tool-call*``); its arguments wrap the
    generated text under the tool's first parameter; ``"required"`` calls the first tool,
    ``"auto"`` answers text; a continuation renders the call and its output."""
    server = await start_emulator(responses_store=True)
    body = {**BODY, "input": "List the files.", "tools": TOOLS, "tool_choice": NAMED,
            "max_output_tokens": 200}
    mine = await _ok(http, server, body)
    n = mine["usage"]["output_tokens"]  # the emulated model stops by itself (32) ...
    real = _fixture("responses-tool-call")
    assert list(mine) == list(real) and key_shape(mine) == key_shape(real)
    item = mine["output"][0]
    assert list(item) == list(real["output"][0]) and mine["tool_choice"] == real["tool_choice"]
    assert item["arguments"] == json.dumps({"command": filler_text(0, n)}) and n < 200
    assert item["call_id"].startswith("chatcmpl-tool-") and item["id"].startswith("fc_")
    assert (item["name"], item["status"], mine["status"]) == ("run", "completed", "completed")
    cut = await _ok(http, server, {**body, "max_output_tokens": 3})  # ... or is cut
    assert (cut["status"], cut["output"][0]["arguments"]) == (
        "incomplete", json.dumps({"command": filler_text(0, 3)}))
    # Streamed: the events a real vLLM sent, one arguments delta per token joined to the whole.
    real_events = anthropic_events(
        (FIXTURES / "vllm-0.32-responses-tool-call-stream.txt").read_text())
    status, _, text = await _post(http, server, {**body, "stream": True})
    events = anthropic_events(text)
    names = [n for n, _ in events]
    assert status == 200 and names == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * n,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [o["sequence_number"] for _, o in events] == list(range(len(events)))
    real_by_name = {n: o for n, o in real_events}
    for name, obj in events:
        assert list(obj) == list(real_by_name[name]), name
        assert key_shape(obj) == key_shape(real_by_name[name]), name
    by_name = dict(events)
    joined = "".join(o["delta"] for n, o in events if n.endswith("arguments.delta"))
    done = by_name["response.completed"]["response"]["output"][0]
    assert joined == by_name["response.function_call_arguments.done"]["arguments"]
    assert joined == done["arguments"] == json.dumps({"command": filler_text(0, n)})
    assert by_name["response.output_item.added"]["item"]["status"] == "in_progress"
    assert by_name["response.output_item.done"]["item"] == done
    # "required": the first tool; "auto": text.
    required = await _ok(http, server, {**body, "tool_choice": "required"})
    auto = await _ok(http, server, {**body, "tool_choice": "auto"})
    assert (required["output"][0]["type"], auto["output"][0]["type"]) == (
        "function_call", "message")
    # The tool's output, continued by id: the call is rendered as the assistant's tool call.
    nxt = await _ok(http, server, {**BODY, "previous_response_id": mine["id"], "input": [
        {"type": "function_call_output", "call_id": item["call_id"], "output": "a.py"}]})
    convo = [{"role": "user", "content": "List the files."},
             {"role": "assistant", "tool_calls": [{"id": item["call_id"], "type": "function",
                                                  "function": {"name": "run",
                                                               "arguments": item["arguments"]}}]},
             {"role": "tool", "content": "a.py", "tool_call_id": item["call_id"]}]
    assert nxt["usage"]["input_tokens"] == len(encode_chat(convo))


async def test_tool_choice_errors_are_vllms(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    server = await start_emulator()
    real = _fixture("responses-error-tool-choice")
    for body in ({**BODY, "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
                 {**BODY, "tool_choice": NAMED}):
        status, _, text = await _post(http, server, body)
        assert (status, json.loads(text)) == (400, real)
    status, _, text = await _post(http, server, {**BODY, "tool_choice": "required"})
    assert (status, json.loads(text)["error"]["message"]) == (
        400, "Tool choice 'required' must be specified with 'tools' parameter."
        " (parameter=tool_choice)")


async def test_a_streamed_background_response_is_kept_and_can_be_followed_again(
    start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    """``background`` and ``stream``, as a real vLLM 0.32 serves them: the events of a
    foreground stream; the response kept ``queued`` while it runs, then finished;
    ``GET ?stream=true&starting_after=N`` replays the events after N; a client that leaves does
    not stop the generation (the emulator runs 20 times slower than its model here)."""
    server = await start_emulator(responses_store=True, time_scale=20)
    body = {**BODY, "background": True, "stream": True, "max_output_tokens": 6}
    async with http.post(server.make_url("/v1/responses"), json=body) as r:
        first = await r.content.readuntil(b"\n\n")
        rid = json.loads(first.split(b"data: ", 1)[1])["response"]["id"]
        async with http.get(server.make_url(f"/v1/responses/{rid}")) as g:
            during = (await g.json())["status"]
        events = anthropic_events((first + await r.read()).decode())
    assert during == "queued"
    assert [n for n, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 6,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert events[0][1]["response"]["background"] is True
    async with http.get(server.make_url(f"/v1/responses/{rid}")) as g:
        kept = await g.json()
    assert kept == events[-1][1]["response"] and kept["status"] == "incomplete"
    async with http.get(server.make_url(f"/v1/responses/{rid}"),
                        params={"stream": "true", "starting_after": "5"}) as g:
        replayed = anthropic_events(await g.text())
    assert replayed == events[6:]
    async with http.get(server.make_url(f"/v1/responses/{rid}"),
                        params={"stream": "true", "starting_after": "x"}) as g:
        assert g.status == 400
    # A client that leaves after the first event: the response still runs to its end.
    async with http.post(server.make_url("/v1/responses"), json=body) as r:
        first = await r.content.readuntil(b"\n\n")
        left = json.loads(first.split(b"data: ", 1)[1])["response"]["id"]
    for _ in range(200):  # bounded: 10 s
        async with http.get(server.make_url(f"/v1/responses/{left}")) as g:
            status = (await g.json())["status"]
        if status != "queued":
            break
        await asyncio.sleep(0.05)
    assert status == "incomplete"
    # Only a streamed background response's events are kept (vLLM breaks the stream instead).
    plain = await _ok(http, server, BODY)
    async with http.get(server.make_url(f"/v1/responses/{plain['id']}"),
                        params={"stream": "true"}) as g:
        assert g.status == 400
