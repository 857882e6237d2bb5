"""Codex-style clients against a real vLLM 0.32 (CPU build, tiny random model) with its
Responses store on: the ``openai`` SDK through the proxy on ``/v1/responses``, a chain of calls
by ``previous_response_id`` with no session header (streamed and not), which the proxy must keep
as one session on one worker, and its usage accounting against what the server reported.

Needs the real-vLLM install and ``MARS_REAL_VLLM_TESTS=1``; shares the ``vllm_dev`` server
(conftest.py).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.responses import Response

from marsproxy.bench.local import start_local
from marsproxy.config import load_config
from marsproxy.core.identity import tenant_of
from marsproxy.emulator.server import EmulatorOptions
from marsproxy.emulator.server import create_app as create_emulator
from marsproxy.gateway.http.app import Running, start
from marsproxy.policy.plane import Phase

from .conftest import LlmEnds

INSTRUCTIONS = "You are a careful coding agent. Read the code before you change it. " * 10


async def test_openai_sdk_responses_chain_through_the_proxy(
    dev_proxy: Running, llm_ends: LlmEnds
) -> None:
    base = f"http://127.0.0.1:{dev_proxy.port}"
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="EMPTY", max_retries=0,
                                timeout=120)
    try:
        r1 = await client.responses.create(model="tiny", instructions=INSTRUCTIONS,
                                           input="List the files.", max_output_tokens=4)
        assert r1.status == "incomplete" and r1.output_text
        # The tool's output, continued by id (the server holds the history; instructions do not
        # carry over, so the client sends them again, as Codex does), streamed.
        async with client.responses.stream(model="tiny", input="a.py b.py",
                                           instructions=INSTRUCTIONS,
                                           previous_response_id=r1.id,
                                           max_output_tokens=4) as s:
            kinds = [e.type async for e in s]
            r2 = await s.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
        r3 = await client.responses.create(model="tiny", input="Run the tests.",
                                           instructions=INSTRUCTIONS,
                                           previous_response_id=r2.id, max_output_tokens=4)
        usages = [r.usage for r in (r1, r2, r3)]
        assert all(u is not None for u in usages)
        # Each call's prompt holds the conversation so far; its prefix came from the cache.
        prompts = [u.input_tokens for u in usages if u is not None]
        assert prompts == sorted(prompts) and prompts[0] < prompts[2]
        cached = [u.input_tokens_details.cached_tokens for u in usages if u is not None]
        assert cached[2] >= 32
        # The proxy: one session for the chain (no header), its prompts and cached parts as
        # the server reported them.
        ends = await llm_ends.wait(3)
        assert len({e["session"] for e in ends}) == 1, ends
        assert [(e["prompt_tokens"], e["cached_tokens"], e["completion_tokens"])
                for e in ends] == [(_u(r).input_tokens, _u(r).input_tokens_details.cached_tokens,
                                    _u(r).output_tokens) for r in (r1, r2, r3)]
        async with aiohttp.ClientSession() as http, http.get(
                f"{base}/mars/v1/state?sessions=1") as resp:
            sessions = (await resp.json())["sessions"]
        assert [d["turns"] for d in sessions["details"]] == [3], sessions
        # An id the server never made: vLLM's 404 comes through as it sent it.
        with pytest.raises(openai.NotFoundError) as nf:
            await client.responses.create(model="tiny", input="go on",
                                          previous_response_id="resp_nope")
        assert isinstance(nf.value.body, dict) and nf.value.body["param"] == "response_id"
    finally:
        await client.close()


async def test_a_background_calls_end_is_its_responses_end_on_the_server(
    dev_proxy: Running, llm_ends: LlmEnds
) -> None:
    """vLLM answers a background call ``queued`` and generates after: through the proxy the call
    stays open (admission sees its session in a call, no ``llm_end`` yet) until the response has
    ended, here found by the client's poll passing through; then ``llm_end`` carries the final
    response's usage, and the session goes on (no tools offered: no answer rule)."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{dev_proxy.port}/v1",
                                api_key="EMPTY", max_retries=0, timeout=120)
    hdr = {"x-session-id": "bg-end"}
    key = f"{tenant_of('Bearer EMPTY')}/id/bg-end"
    try:
        queued = await client.responses.create(model="tiny", input="Say hello.",
                                               max_output_tokens=64, background=True,
                                               temperature=0, extra_headers=hdr)
        open_phase = dev_proxy.gateway.plane.phase(key)  # the proxy polls after 2 s only
        ends_then = list(llm_ends.events)
        done = await _polled(client, queued, hdr)
        ends = await llm_ends.wait(1)
    finally:
        await client.close()
    assert queued.status == "queued" and queued.usage is None
    assert open_phase is Phase.IN_CALL and ends_then == []
    assert done.status in ("completed", "incomplete")
    assert [(e["session"], e["prompt_tokens"], e["completion_tokens"]) for e in ends] == [
        (key, _u(done).input_tokens, _u(done).output_tokens)]
    assert dev_proxy.gateway.plane.phase(key) is Phase.DORMANT
    assert len(dev_proxy.gateway.background) == 0


async def test_a_streamed_background_response_whose_client_left_keeps_its_call(
    dev_proxy: Running, llm_ends: LlmEnds
) -> None:
    """vLLM goes on generating a background response whose streaming client left: through the
    proxy its call stays open until the response ends, here by a cancel passing through."""
    base = f"http://127.0.0.1:{dev_proxy.port}"
    key = f"{tenant_of('Bearer EMPTY')}/id/bg-left"
    hdr = {"x-session-id": "bg-left", "Authorization": "Bearer EMPTY"}
    body = {"model": "tiny", "input": "Say hello.", "background": True, "stream": True,
            "max_output_tokens": 256, "temperature": 0}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/responses", json=body, headers=hdr) as r:
            assert r.status == 200
            first = await r.content.readuntil(b"\n\n")
            r.close()  # the client leaves after response.created
        rid = json.loads(first.split(b"data: ", 1)[1])["response"]["id"]
        for _ in range(100):  # the proxy sees the client gone at its next write
            if len(dev_proxy.gateway.background) == 1:
                break
            await asyncio.sleep(0.05)
        open_phase = dev_proxy.gateway.plane.phase(key)
        async with http.post(f"{base}/v1/responses/{rid}/cancel", headers=hdr) as r:
            cancel = r.status, (await r.json()).get("status")
        for _ in range(100):
            if dev_proxy.gateway.plane.phase(key) is not Phase.IN_CALL:
                break
            await asyncio.sleep(0.05)
    assert open_phase is Phase.IN_CALL
    # The tiny random model may have stopped early: then vLLM's 400 for a finished response.
    assert cancel in ((200, "cancelled"), (400, None)), cancel
    assert dev_proxy.gateway.plane.phase(key) is not Phase.IN_CALL
    assert len(dev_proxy.gateway.background) == 0
    assert [e["session"] for e in await llm_ends.wait(1)] == [key]


async def _polled(client: openai.AsyncOpenAI, queued: Response,
                  headers: dict[str, str]) -> Response:
    """A background response polled through the proxy until it is no longer queued (30 s at
    most)."""
    done = queued
    for _ in range(300):
        done = await client.responses.retrieve(queued.id, extra_headers=headers)
        if done.status != "queued":
            break
        await asyncio.sleep(0.1)
    return done


def _u(r: Response) -> Any:
    assert r.usage is not None
    return r.usage


async def test_a_replica_that_never_saw_a_reply_asks_the_workers_who_keeps_it(
    vllm_dev: str,
) -> None:
    """Two proxies that share no store, in front of the real vLLM and an emulated worker (both
    keeping responses): a chain made through the first continues through the second, which
    asks both workers for the id (the real one answers ``GET /v1/responses/{id}`` with 200) and
    sends the call there; retrieving and cancelling the response go there too, and vLLM's
    answers come back as it sent them."""
    emulated = await start_local(create_emulator(EmulatorOptions(
        profile="tiny", served_model_name="tiny", responses_store=True)))
    workers = [{"url": vllm_dev, "name": "vllm", "priority": True},
               {"url": emulated.url, "name": "emulated"}]
    proxies = []
    for _ in range(2):
        proxies.append(await start(load_config(environ={}, overrides={
            "server": {"port": 0}, "workers": workers, "probes": {"nvml": {"enabled": False}},
        })))
    base = [f"http://127.0.0.1:{p.port}" for p in proxies]
    clients = [openai.AsyncOpenAI(base_url=f"{b}/v1", api_key="EMPTY", max_retries=0,
                                  timeout=120) for b in base]
    try:
        r1 = await clients[0].responses.create(model="tiny", input="List the files.",
                                               max_output_tokens=4)
        # The second proxy's own session takes the real worker: its least loaded is the other.
        await clients[1].chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_headers={"x-session-id": "busy"})
        r2 = await clients[1].responses.create(model="tiny", input="a.py b.py",
                                               previous_response_id=r1.id, max_output_tokens=4)
        got = await clients[1].responses.retrieve(r2.id)
        with pytest.raises(openai.BadRequestError) as bad:
            await clients[1].responses.cancel(r2.id)
        async with aiohttp.ClientSession() as http:
            states = [await (await http.get(f"{b}/mars/v1/state?sessions=1")).json()
                      for b in base]
    finally:
        for c in clients:
            await c.close()
        for p in proxies:
            await p.stop()
        await emulated.stop()
    assert got.id == r2.id and got.previous_response_id == r1.id
    assert isinstance(bad.value.body, dict)
    assert bad.value.body["message"] == "Cannot cancel a synchronous response."
    where = {d["id"]: d["worker"] for st in states for d in st["sessions"]["details"]}
    assert set(where.values()) == {"vllm"}, where  # every session on the worker keeping it


async def test_a_background_response_is_polled_and_cancelled_through_the_proxy(
    vllm_dev: str,
) -> None:
    """``background: true`` through the proxy, in front of the real vLLM and an emulated worker:
    vLLM answers ``queued`` at once; polling ``GET /v1/responses/{id}`` through the proxy reaches
    the worker that runs it until it is done, the chain goes on from it, a streamed one is
    replayed from the worker by ``GET ?stream=true&starting_after=N``, and a long one is
    cancelled there (vLLM's ``cancelled``, or its 400 where it ended first: the tiny random model
    may stop early); the emulated worker answers alike (50 times slower than its model: its
    replies end at 32 tokens, in 0.05 s at full pace)."""
    emulated = await start_local(create_emulator(EmulatorOptions(
        profile="tiny", served_model_name="tiny", responses_store=True, time_scale=50)))
    workers = [{"url": vllm_dev, "name": "vllm", "priority": True},
               {"url": emulated.url, "name": "emulated"}]
    proxy = await start(load_config(environ={}, overrides={
        "server": {"port": 0}, "workers": workers, "probes": {"nvml": {"enabled": False}}}))
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="EMPTY",
                                max_retries=0, timeout=120)
    seen: list[tuple[str, str, str]] = []
    stopped: list[str] = []
    try:
        for sid in ("bg-a", "bg-b"):  # the second session goes to the other worker
            hdr = {"x-session-id": sid}
            queued = await client.responses.create(model="tiny", input="List the files.",
                                                   max_output_tokens=4, background=True,
                                                   extra_headers=hdr)
            done = await _polled(client, queued, hdr)
            nxt = await client.responses.create(model="tiny", input="a.py", max_output_tokens=2,
                                                previous_response_id=queued.id, extra_headers=hdr)
            # The tiny random model mostly writes this prompt up to the budget.
            long = await client.responses.create(model="tiny", input="Say hello.",
                                                 background=True, max_output_tokens=3000,
                                                 temperature=0, extra_headers=hdr)
            try:  # at the worker keeping it (elsewhere: 404) ...
                cancelled = (await client.responses.cancel(long.id, extra_headers=hdr)).status
            except openai.BadRequestError as exc:  # ... which may have ended it already
                assert isinstance(exc.body, dict), exc
                cancelled = str(exc.body["message"])
            # Streamed: the events, then replayed after the third through the proxy.
            live = [e async for e in await client.responses.create(
                model="tiny", input="Say hi.", max_output_tokens=4, background=True,
                stream=True, extra_headers=hdr)]
            rid = live[0].response.id  # type: ignore[union-attr]
            again = [e async for e in await client.responses.retrieve(
                rid, stream=True, starting_after=2, extra_headers=hdr)]
            assert [e.type for e in again] == [e.type for e in live[3:]], (sid, again)
            assert [e.sequence_number for e in again] == list(range(3, len(live)))
            seen.append((queued.status, done.status, nxt.status))
            stopped.append(cancelled)
        async with aiohttp.ClientSession() as http, http.get(
                f"http://127.0.0.1:{proxy.port}/mars/v1/state?sessions=1") as resp:
            where = {d["id"]: d["worker"] for d in (await resp.json())["sessions"]["details"]}
    finally:
        await client.close()
        await proxy.stop()
        await emulated.stop()
    assert seen == [("queued", "incomplete", "incomplete")] * 2, seen
    assert set(stopped) <= {"cancelled", "Cannot cancel a synchronous response."}, stopped
    assert sorted(where.values()) == ["emulated", "vllm"], where
