"""docs/integrations.md, tested: real client libraries (openai SDK, LiteLLM) drive a real
marsproxy gateway in front of emulated vLLM workers; each session must be identified (its id in
``/mars/v1/state?sessions=1``), streamed (several chunks reach the client), and counted (turns
per session, ``marsproxy_requests_total``)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "coder"

# LiteLLM's own TypedDicts warn at import under pydantic 2; nothing marsproxy can act on.
pytestmark = pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")


def _sample(metrics: str, name: str, **labels: str) -> float:
    """Sum of the samples ``name`` whose labels include ``labels`` (0 when none)."""
    total = 0.0
    for fam in text_string_to_metric_families(metrics):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _history(n: int) -> list[Any]:
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": f"Fix the failing test number {n} in this repository."},
    ]


async def test_openai_sdk_default_headers_streamed_and_counted(make_stack: Any) -> None:
    from openai import AsyncOpenAI

    stack = await make_stack(workers=2)
    ids = [f"run-{uuid.uuid4().hex[:8]}" for _ in range(2)]

    async def session(i: int, sid: str) -> int:
        client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="EMPTY",
                             default_headers={"x-session-id": sid})
        messages: list[Any] = _history(i)
        chunks = 0
        for turn in range(3):
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=16, stream=True,
                stream_options={"include_usage": True},
            )
            text = []
            async for chunk in stream:
                chunks += 1
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
            messages += [{"role": "assistant", "content": "".join(text)},
                         {"role": "user", "content": f"tool output {turn}"}]
        await client.close()
        return chunks

    chunks = await asyncio.gather(*(session(i, sid) for i, sid in enumerate(ids)))
    assert all(c > 3 * 2 for c in chunks), chunks  # streamed: several chunks per call

    sessions = await stack.sessions()
    for sid in ids:
        assert sid in sessions, sessions.keys()
        assert sessions[sid]["turns"] == 3
        assert sessions[sid]["worker"] in {"w0", "w1"}
    metrics = await stack.metrics()
    assert _sample(metrics, "marsproxy_requests_total", route="chat", code="200") == 6


async def test_openai_sdk_non_streaming_and_final_header(make_stack: Any) -> None:
    from openai import AsyncOpenAI

    stack = await make_stack()
    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="EMPTY",
                         default_headers={"x-session-id": "one-shot"})
    r = await client.chat.completions.create(
        model=MODEL, messages=_history(0), max_tokens=8,
        extra_headers={"x-session-final": "true"},
    )
    await client.close()
    assert r.choices[0].message.content
    assert r.usage is not None and r.usage.completion_tokens > 0
    metrics = await stack.metrics()
    assert _sample(metrics, "marsproxy_requests_total", route="chat", code="200") == 1


async def test_codex_style_responses_chains_by_previous_response_id(make_stack: Any) -> None:
    """Two Responses conversations continued by ``previous_response_id`` (no session header),
    against two workers that keep their own responses (vLLM's store): each chain is one session
    and stays on the worker holding its replies (any other would answer 404)."""
    from openai import AsyncOpenAI

    stack = await make_stack(workers=2, responses_store=True)
    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="EMPTY", max_retries=0)

    async def chain(n: int) -> list[str]:
        r = await client.responses.create(model=MODEL, instructions="You are a coding agent.",
                                          input=f"Fix the failing test number {n}.",
                                          max_output_tokens=8)
        ids = [r.id]
        for turn in range(2):
            r = await client.responses.create(
                model=MODEL, instructions="You are a coding agent.", input=f"tool output {turn}",
                previous_response_id=ids[-1], max_output_tokens=8)
            assert r.usage is not None and r.usage.input_tokens_details.cached_tokens > 0
            ids.append(r.id)
        return ids

    await asyncio.gather(chain(0), chain(1))
    await client.close()
    sessions = await stack.sessions()
    assert sorted(s["turns"] for s in sessions.values()) == [3, 3], sessions
    assert {s["worker"] for s in sessions.values()} == {"w0", "w1"}
    metrics = await stack.metrics()
    assert _sample(metrics, "marsproxy_requests_total", route="responses", code="200") == 6


async def test_codex_style_agent_loop_ends_its_session_on_its_answer(make_stack: Any) -> None:
    """An agent loop on the Responses API with tools: the emulated worker answers a forced
    choice with a ``function_call``, the tool's output goes back by ``previous_response_id``,
    and the reply that calls no tool (the answer) ends the session, freeing its slot, as a
    chat agent's answer does."""
    from openai import AsyncOpenAI

    from marsproxy.core.identity import tenant_of
    from marsproxy.policy.plane import Phase

    stack = await make_stack(workers=1, responses_store=True)
    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="EMPTY", max_retries=0,
                         default_headers={"x-session-id": "loop"})
    tools: Any = [{"type": "function", "name": "run", "description": "Run a command",
                   "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}]
    plane = stack.gateway.gateway.plane
    key = f"{tenant_of('Bearer EMPTY')}/id/loop"
    r = await client.responses.create(model=MODEL, input="Fix the failing test.", tools=tools,
                                      tool_choice="required", max_output_tokens=8)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "run"
    await asyncio.sleep(0.1)  # the after-work of the call has run by now
    after_call = plane.phase(key)
    answer = await client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=tools, max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "1 passed"}])
    await client.close()
    assert answer.output[0].type == "message"  # "auto": the emulated model answers in text
    for _ in range(100):  # bounded: 5 s
        if plane.phase(key) is Phase.ENDED:
            break
        await asyncio.sleep(0.05)
    assert (after_call, plane.phase(key)) == (Phase.DORMANT, Phase.ENDED)


@pytest.fixture(scope="module")
def litellm() -> Any:
    # Never fetch the model price map from the network at import.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    mod = pytest.importorskip("litellm", reason="litellm is not installed")
    mod.telemetry = False
    return mod


@pytest.mark.parametrize("provider", ["hosted_vllm", "openai"])
async def test_litellm_extra_headers(make_stack: Any, litellm: Any, provider: str) -> None:
    """LiteLLM as a library (also what mini-swe-agent does with model_kwargs.extra_headers)."""
    stack = await make_stack()
    sid = f"litellm-{provider}-{uuid.uuid4().hex[:6]}"
    messages: list[Any] = _history(1)
    for turn in range(2):
        resp = await litellm.acompletion(
            model=f"{provider}/{MODEL}", api_base=f"{stack.url}/v1", api_key="EMPTY",
            messages=messages, max_tokens=16, stream=True,
            extra_headers={"x-session-id": sid},
        )
        parts = [c.choices[0].delta.content or "" async for c in resp if c.choices]
        assert len(parts) > 2  # streamed
        messages += [{"role": "assistant", "content": "".join(parts)},
                     {"role": "user", "content": f"tool output {turn}"}]
    sessions = await stack.sessions()
    assert sid in sessions, sessions.keys()
    assert sessions[sid]["turns"] == 2
    metrics = await stack.metrics()
    assert _sample(metrics, "marsproxy_requests_total", route="chat", code="200") == 2


async def test_openhands_style_litellm_session_header_and_prompt_cache_key(
    make_stack: Any, litellm: Any
) -> None:
    """OpenHands sends x-litellm-session-id and prompt_cache_key (both the conversation id)."""
    stack = await make_stack()
    conv = uuid.uuid4().hex
    resp = await litellm.acompletion(
        model=f"openai/{MODEL}", api_base=f"{stack.url}/v1", api_key="EMPTY",
        messages=_history(2), max_completion_tokens=16, stream=True,
        extra_headers={"x-litellm-session-id": conv}, prompt_cache_key=conv,
    )
    assert len([c async for c in resp]) > 2
    # Without the header, prompt_cache_key alone names the session.
    conv2 = uuid.uuid4().hex
    r = await litellm.acompletion(
        model=f"openai/{MODEL}", api_base=f"{stack.url}/v1", api_key="EMPTY",
        messages=_history(3), max_completion_tokens=16, prompt_cache_key=conv2,
    )
    assert r.choices[0].message.content
    sessions = await stack.sessions()
    assert conv in sessions and conv2 in sessions, sessions.keys()


async def test_claude_code_style_messages_route(make_stack: Any) -> None:
    """/v1/messages with x-claude-code-session-id: streamed through, session identified."""
    stack = await make_stack(anthropic=True)
    sid = str(uuid.uuid4())
    body = {"model": MODEL, "max_tokens": 32, "stream": True,
            "messages": [{"role": "user", "content": "List the files."}]}
    headers = {"x-api-key": "EMPTY", "anthropic-version": "2023-06-01",
               "x-claude-code-session-id": sid}
    async with httpx.AsyncClient(timeout=10) as c:
        for _ in range(2):
            async with c.stream("POST", f"{stack.url}/v1/messages", json=body,
                                headers=headers) as r:
                assert r.status_code == 200
                events = [ln async for ln in r.aiter_lines() if ln.startswith("event: ")]
            assert events[0] == "event: message_start" and events[-1] == "event: message_stop"
    assert stack.seen_headers[0].get("x-claude-code-session-id") == sid  # passed through
    sessions = await stack.sessions()
    assert sid in sessions and sessions[sid]["turns"] == 2
    metrics = await stack.metrics()
    assert _sample(metrics, "marsproxy_requests_total", route="messages", code="200") == 2


async def test_compose_example_agent(make_stack: Any, repo: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/compose/agent/agent.py, as the compose files run it, against a real gateway."""
    stack = await make_stack(workers=2)
    monkeypatch.setenv("OPENAI_BASE_URL", f"{stack.url}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "EMPTY")
    monkeypatch.setenv("MODEL", MODEL)
    monkeypatch.setenv("AGENT_SESSIONS", "3")
    monkeypatch.setenv("AGENT_TURNS", "2")
    monkeypatch.setenv("AGENT_TOOL_SECONDS", "0.01")
    spec = importlib.util.spec_from_file_location(
        "compose_agent", repo / "deploy/compose/agent/agent.py"
    )
    assert spec is not None and spec.loader is not None
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    assert await agent.main() == 0
    metrics = await stack.metrics()
    assert _sample(metrics, "marsproxy_requests_total", route="chat", code="200") == 6
    assert _sample(metrics, "marsproxy_tokens_total", kind="completion") > 0
