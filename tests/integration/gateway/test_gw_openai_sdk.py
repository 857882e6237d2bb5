"""The openai SDK → marsproxy → two emulated vLLM workers, all over real sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from aiohttp import web

from marsproxy.config import load_config
from marsproxy.emulator.server import RUNNER_KEY, EmulatorOptions, create_app
from marsproxy.gateway.http.app import Running, start

MODEL = "tiny-emulated"
MSGS: list[Any] = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the failing test in foo.py."},
]


@dataclass
class Setup:
    proxy: Running
    workers: list[tuple[web.AppRunner, str]]
    apps: list[web.Application]
    # Closed at teardown: a client left to the garbage collector closes itself on whatever
    # event loop runs then (a later test's), or on a closed one, logging an error there.
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    def client(self, session: str | None = None) -> openai.AsyncOpenAI:
        headers = {"x-session-id": session} if session else {}
        return self._kept(openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{self.proxy.port}/v1",
            api_key="sk-test",
            default_headers=headers,
            max_retries=0,
        ))

    def direct(self, i: int = 0) -> openai.AsyncOpenAI:
        return self._kept(openai.AsyncOpenAI(
            base_url=self.workers[i][1] + "/v1", api_key="sk-test", max_retries=0
        ))

    def _kept(self, client: openai.AsyncOpenAI) -> openai.AsyncOpenAI:
        self.clients.append(client)
        return client

    def per_worker(self) -> list[int]:
        counts = self.proxy.gateway.stats()["requests_per_worker"]
        return [counts[self.label(i)] for i in range(len(self.workers))]

    def label(self, i: int) -> str:
        return self.workers[i][1].split("//", 1)[1]

    def worker_of(self, session_id: str) -> str:
        """The worker label of an explicit session id (keys are tenant-scoped)."""
        found = self.proxy.gateway.stats()["session_workers"]
        (label,) = [w for k, w in found.items() if k.endswith("/id/" + session_id)]
        return str(label)

    def running(self) -> int:
        return sum(app[RUNNER_KEY].engine.stats().running for app in self.apps)


@pytest.fixture
async def env(run_app: Any) -> AsyncIterator[Setup]:
    apps = [create_app(EmulatorOptions(profile="tiny", time_scale=0.2)) for _ in range(2)]
    workers = [await run_app(a) for a in apps]
    cfg = load_config(
        None,
        environ={},
        overrides={
            "workers": [u for _, u in workers],
            "server": {"port": 0},
            "health": {"interval_s": 0.1, "timeout_s": 0.5},
        },
    )
    proxy = await start(cfg)
    setup = Setup(proxy, workers, apps)
    yield setup
    for client in setup.clients:
        await client.close()
    await proxy.stop()
    for runner, _ in workers:
        await runner.cleanup()


async def _text_of_stream(stream: Any) -> tuple[str, list[Any]]:
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


async def test_chat_same_as_direct_streaming_or_not(env: Setup) -> None:
    kw: dict[str, Any] = {"model": MODEL, "messages": MSGS, "max_tokens": 12}
    proxy, direct = env.client("s-chat"), env.direct()
    want = await direct.chat.completions.create(**kw)
    got = await proxy.chat.completions.create(**kw)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage is not None and want.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        want.usage.prompt_tokens,
        want.usage.completion_tokens,
    )

    # Streaming without include_usage: same text, and no usage chunk reaches the client.
    text, chunks = await _text_of_stream(await proxy.chat.completions.create(**kw, stream=True))
    assert text == want.choices[0].message.content
    assert all(c.usage is None and c.choices for c in chunks)

    # With include_usage: the client gets the usage chunk it asked for.
    text, chunks = await _text_of_stream(
        await proxy.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
    )
    assert text == want.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens


async def test_completions_same_as_direct_streaming_or_not(env: Setup) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": "def main():", "max_tokens": 10}
    proxy, direct = env.client("s-cmpl"), env.direct(1)
    want = await direct.completions.create(**kw)
    got = await proxy.completions.create(**kw)
    assert got.choices[0].text == want.choices[0].text
    assert got.usage is not None and want.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        want.usage.prompt_tokens,
        want.usage.completion_tokens,
    )
    chunks = [c async for c in await proxy.completions.create(**kw, stream=True)]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
    assert all(c.usage is None for c in chunks)


async def test_completions_chain_by_prompt_prefix(env: Setup) -> None:
    client = env.client()
    prompts = ["# task: add two numbers\n", "# task: add two numbers\n"]
    for turn in range(3):
        for i in range(2):
            got = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=3)
            prompts[i] += got.choices[0].text + f"\n# observation {turn}\n"
    assert env.per_worker() == [3, 3]  # both runs stayed on their first worker
    assert env.proxy.gateway.stats()["sessions"] == 2


async def test_session_affinity_and_spread(env: Setup) -> None:
    a, b = env.client("session-a"), env.client("session-b")
    await a.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    await b.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    assert env.per_worker() == [1, 1]  # two sessions, two workers
    for _ in range(3):
        await a.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    assert sorted(env.per_worker()) == [1, 4]  # all of a's turns on a's worker
    assert env.worker_of("session-a") != env.worker_of("session-b")


async def test_chain_matching_keeps_concurrent_identical_runs_apart(env: Setup) -> None:
    client = env.client()  # no session id at all, like mini-swe-agent

    async def streamed(messages: list[Any]) -> str:
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, stream=True
        )
        text, _ = await _text_of_stream(stream)
        return text

    # Turn 1 streamed (reply captured from SSE deltas), turn 2 not (captured from the body).
    first = await asyncio.gather(streamed(MSGS), streamed(MSGS))
    assert env.per_worker() == [1, 1] and env.proxy.gateway.stats()["sessions"] == 2
    second = [
        [*MSGS, {"role": "assistant", "content": text}, {"role": "user", "content": f"obs {i}"}]
        for i, text in enumerate(first)
    ]
    replies = await asyncio.gather(
        *(client.chat.completions.create(model=MODEL, messages=m, max_tokens=4) for m in second)
    )
    assert env.per_worker() == [2, 2]  # each continuation stayed with its own run
    third = [
        [
            *m,
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "obs"},
        ]
        for m, r in zip(second, replies, strict=True)
    ]
    for m in third:
        await client.chat.completions.create(model=MODEL, messages=m, max_tokens=4)
    assert env.per_worker() == [3, 3]
    assert env.proxy.gateway.stats()["sessions"] == 2


async def test_client_disconnect_cancels_upstream(env: Setup, until: Any) -> None:
    stream = await env.client("s-cancel").chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=8000, stream=True, extra_body={"ignore_eos": True}
    )
    async for _ in stream:
        break
    assert env.running() == 1
    await stream.close()
    await until(lambda: env.running() == 0)


async def test_dead_worker_is_routed_around(env: Setup, until: Any) -> None:
    client = env.client("s-moving")
    await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    home = env.worker_of("s-moving")
    idx = [env.label(i) for i in range(2)].index(home)
    await env.workers[idx][0].cleanup()
    got = await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    assert got.choices[0].message.content
    assert env.worker_of("s-moving") == env.label(1 - idx)
    await until(lambda: env.proxy.gateway.stats()["healthy"][home] is False)
    other = await env.client("s-new").chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=2
    )
    assert other.choices[0].message.content


async def test_upstream_404_passes_through(env: Setup) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        await env.client().chat.completions.create(model="nope", messages=MSGS)
    assert exc.value.status_code == 404
    models = await env.client().models.list()  # pass-through route
    assert [m.id for m in models.data] == [MODEL]
