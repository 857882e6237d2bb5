"""Codex-style clients against a real vLLM 0.32 (CPU build, tiny random model) with its
Responses store on: the ``openai`` SDK through the proxy on ``/v1/responses``, a chain of calls
by ``previous_response_id`` with no session header (streamed and not), which the proxy must keep
as one session on one worker, and its usage accounting against what the server reported.

Needs the real-vLLM install and ``MARS_REAL_VLLM_TESTS=1``; shares the ``vllm_dev`` server
(conftest.py).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest
from openai.types.responses import Response

from marsproxy.gateway.http.app import Running

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


def _u(r: Response) -> Any:
    assert r.usage is not None
    return r.usage
