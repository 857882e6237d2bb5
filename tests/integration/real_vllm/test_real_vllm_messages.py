"""Claude-Code-style clients against a real vLLM 0.32 (CPU build, tiny random model): the
``anthropic`` SDK through the proxy on ``/v1/messages``, streaming and not, a tool round trip
in the history, Claude Code's session and sub-agent headers, and the proxy's usage accounting
(vLLM's ``input_tokens`` excludes the cached part) against what the server reported.

The worker is marked ``priority: true``; vLLM reads no ``priority`` on this route, so the proxy
splices none there and its calls wait in the dispatch gate instead. Needs the real-vLLM
install and ``MARS_REAL_VLLM_TESTS=1``; shares the ``vllm_dev`` server (conftest.py).
"""

from __future__ import annotations

import uuid

import anthropic
import pytest
from anthropic.types import MessageParam, Usage

from marsproxy.gateway.http.app import Running

from .conftest import LlmEnds

SYSTEM = "You are a careful coding agent. Read the code before you change it. " * 10


def _prompt(u: Usage) -> int:
    return u.input_tokens + (u.cache_read_input_tokens or 0) + (
        u.cache_creation_input_tokens or 0)


async def test_anthropic_sdk_through_the_proxy(dev_proxy: Running, llm_ends: LlmEnds) -> None:
    base = f"http://127.0.0.1:{dev_proxy.port}"
    sid = str(uuid.uuid4())
    headers = {"x-claude-code-session-id": sid}
    client = anthropic.AsyncAnthropic(base_url=base, api_key="EMPTY", default_headers=headers,
                                      max_retries=0, timeout=120)
    try:
        first: list[MessageParam] = [{"role": "user", "content": "List the files."}]
        m1 = await client.messages.create(model="tiny", max_tokens=4, system=SYSTEM,
                                          messages=first)
        assert m1.type == "message" and m1.content and m1.content[0].type == "text"
        assert m1.stop_reason in ("max_tokens", "end_turn")
        # The next turn: the reply, a tool call and its result appended (the tiny model's
        # template renders them); everything before it comes from the prefix cache.
        second: list[MessageParam] = [*first, {"role": "assistant", "content": [
            {"type": "text", "text": m1.content[0].text},
            {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"cmd": "ls"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py b.py"}]}]
        sub = {"x-claude-code-agent-id": "a" + uuid.uuid4().hex[:16],
               "x-claude-code-parent-agent-id": "main"}
        async with client.messages.stream(
            model="tiny", max_tokens=4, system=SYSTEM, messages=second,
            extra_headers=sub,
        ) as s:
            kinds = [e.type async for e in s]
            m2 = await s.get_final_message()
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        assert "content_block_start" in kinds and "content_block_stop" in kinds
        assert m2.usage.cache_read_input_tokens and m2.usage.cache_read_input_tokens >= 32
        assert _prompt(m2.usage) > _prompt(m1.usage)
        # The proxy's view: the main agent's session (the header) and the sub-agent's own,
        # linked to it; prompts with their cached part.
        e1, e2 = await llm_ends.wait(2)
        assert e1["session"].endswith(f"/id/{sid}")
        assert e2["session"] == f"{e1['session']}/agent/{sub['x-claude-code-agent-id']}"
        assert (e1["prompt_tokens"], e1["completion_tokens"]) == (
            _prompt(m1.usage), m1.usage.output_tokens)
        assert (e2["prompt_tokens"], e2["cached_tokens"], e2["completion_tokens"]) == (
            _prompt(m2.usage), m2.usage.cache_read_input_tokens, m2.usage.output_tokens)
        n = await client.messages.count_tokens(model="tiny", system=SYSTEM, messages=second)
        assert n.input_tokens == _prompt(m2.usage)
        # vLLM's errors come through as it sent them.
        with pytest.raises(anthropic.BadRequestError) as bad:
            await client.messages.create(model="tiny", max_tokens=0, messages=first)
        assert isinstance(bad.value.body, dict)
        assert bad.value.body["error"]["param"] == "body.max_tokens"
        with pytest.raises(anthropic.NotFoundError) as nf:
            await client.messages.create(model="nope", max_tokens=2, messages=first)
        assert isinstance(nf.value.body, dict) and nf.value.body["type"] == "error"
        assert nf.value.body["error"]["type"] == "NotFoundError"
    finally:
        await client.close()
