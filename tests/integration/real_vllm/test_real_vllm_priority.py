"""Against a real vLLM 0.32 (CPU build, tiny random model): the proxy's priority reaches the
engine and changes completion order, and the ``priority: auto`` probe tells a server run with
``--scheduling-policy priority`` from one without it (which accepts ``priority`` silently).

Needs the real-vLLM install and ``MARS_REAL_VLLM_TESTS=1`` (conftest.py). Each server takes
20-60 s to start on 2 cores; the module starts two (priority, fcfs), one after the other.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from marsproxy.config import load_config
from marsproxy.gateway.http.app import Running, start


@pytest.fixture(scope="module")
def vllm_priority(start_vllm: Any) -> Iterator[str]:
    # One sequence at a time: everything after the blocker waits in the engine's own queue,
    # where --scheduling-policy priority orders it by the body's priority. Room for the blocker
    # (~128 blocks of 32) and the long prompt (~94) at once.
    with start_vllm("priority", "--max-num-seqs", "1", "--max-num-batched-tokens", "512",
                    NUM_BLOCKS="300") as url:
        yield url


@pytest.fixture(scope="module")
def vllm_fcfs(start_vllm: Any) -> Iterator[str]:
    with start_vllm("fcfs", "--max-num-batched-tokens", "512") as url:
        yield url


async def _proxy(url: str, policy: str, priority: bool | str) -> Running:
    cfg = load_config(environ={}, overrides={
        "policy": policy, "server": {"port": 0},
        "workers": [{"url": url, "name": "vllm", "priority": priority}],
        "probes": {"nvml": {"enabled": False}},
    })
    return await start(cfg)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        yield s


async def _complete(http: aiohttp.ClientSession, base: str, session: str, prompt: list[int],
                    max_tokens: int, done: list[str]) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    async with http.post(f"{base}/v1/completions", json=body,
                         headers={"x-session-id": session}) as r:
        assert r.status == 200, await r.text()
        out: dict[str, Any] = await r.json()
    done.append(session)
    return out


def _engine_core(url: str, run_dir: Path) -> psutil.Process:
    """The server's engine-core process (its scheduler), found under the pid start.sh wrote."""
    port = url.rsplit(":", 1)[1]
    server = psutil.Process(int((run_dir / f"vllm-{port}.pid").read_text()))
    for child in server.children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()) or "EngineCor" in child.name():
            return child
    raise AssertionError(f"no EngineCore process under the vLLM server {server.pid}")


async def _order(http: aiohttp.ClientSession, base: str, engine: str, run_dir: Path
                 ) -> list[str]:
    """Five requests reach a paused engine: a blocker (a 4080-token decode), a new session's
    long cold prompt (3000 tokens), then three short continuations of sessions that started
    before it (session order puts them first). The engine resumes, runs the blocker (the
    earliest session) in its only slot (about a second) while it takes in the other four, then
    picks among them. Returns the order in which those four completed.

    Pausing the engine core (SIGSTOP) is what makes them queue together: the tiny model decodes
    thousands of tokens a second, so no blocker lasts long enough for requests sent one after
    another to meet in the queue on a fast machine, and the API server in front of the engine
    lags unpredictably on a busy one.
    """
    rng = random.Random()

    def ids(n: int) -> list[int]:  # fresh ids: no prefix-cache hit shortens anything
        return [rng.randrange(100, 1000) for _ in range(n)]

    for session in ("blocker", "short0", "short1", "short2"):  # earlier turns: older sessions
        await _complete(http, base, session, ids(10), 1, [])
    core = _engine_core(engine, run_dir)
    done: list[str] = []
    core.suspend()
    try:
        blocker = asyncio.create_task(_complete(http, base, "blocker", ids(8), 4080, done))
        await asyncio.sleep(0.3)
        long = asyncio.create_task(_complete(http, base, "long", ids(3000), 1, done))
        await asyncio.sleep(0.3)
        shorts = [asyncio.create_task(_complete(http, base, f"short{i}", ids(10), 2, done))
                  for i in range(3)]
        await asyncio.sleep(1.0)  # the API server passes all five on to the paused engine
    finally:
        core.resume()
    tasks = [blocker, long, *shorts]
    _, pending = await asyncio.wait(tasks, timeout=50)
    if pending:  # say who never came back, and where the proxy holds them, before failing
        async with http.get(f"{base}/mars/v1/state") as r:
            state = await r.json()
        for t in pending:
            t.cancel()
        raise AssertionError(f"not back within 50 s after the engine resumed; done: {done};"
                             f" scheduler: {state.get('scheduler')};"
                             f" workers: {state.get('workers')}")
    for t in tasks:
        t.result()  # a failed request fails the test here
    assert done[0] == "blocker", f"the blocker did not take the slot first: {done}"
    return done[1:]


async def test_proxy_priority_reaches_the_engine_and_changes_completion_order(
    vllm_priority: str, http: aiohttp.ClientSession, real_vllm_run_dir: Path
) -> None:
    proxy = await _proxy(vllm_priority, "mars-no-admission", True)
    try:
        order = await _order(http, f"http://127.0.0.1:{proxy.port}", vllm_priority,
                             real_vllm_run_dir)
    finally:
        await proxy.stop()
    assert order[-1] == "long", order  # every short first
    # The same server and traffic through the fcfs preset (no priority in the body): the
    # engine serves in arrival order.
    proxy = await _proxy(vllm_priority, "fcfs", True)
    try:
        order = await _order(http, f"http://127.0.0.1:{proxy.port}", vllm_priority,
                             real_vllm_run_dir)
    finally:
        await proxy.stop()
    assert order[0] == "long", order


async def _probed(url: str, run_dir: Path) -> tuple[str, str]:
    """The proxy's start-up probe against ``url``, its three requests sent while the engine
    core is paused, so they meet in the engine's queue as the probe intends. Unpaused, a fast
    engine finishes the probe's blocker before the API server (sharing 2 cores with everything
    else) hands it the next request, and the probe reads a priority server as gated: safe, but
    not what these tests are about."""
    core = _engine_core(url, run_dir)
    core.suspend()
    try:
        proxy = await _proxy(url, "mars-no-admission", "auto")
        await asyncio.sleep(1.5)  # the probe's requests reach the API server and wait there
    finally:
        core.resume()
    try:
        shell = proxy.gateway.scheduler
        for _ in range(600):
            if not shell.mode_reason["vllm"].startswith("auto: probe pending"):
                break
            await asyncio.sleep(0.1)
        return shell.core.modes["vllm"], shell.mode_reason["vllm"]
    finally:
        await proxy.stop()


async def test_auto_probe_finds_priority_on_a_priority_server(
    vllm_priority: str, real_vllm_run_dir: Path
) -> None:
    mode, reason = await _probed(vllm_priority, real_vllm_run_dir)
    assert mode == "priority", reason


async def test_auto_probe_finds_no_priority_on_a_default_server(
    vllm_fcfs: str, real_vllm_run_dir: Path
) -> None:
    mode, reason = await _probed(vllm_fcfs, real_vllm_run_dir)
    assert mode == "gated", reason
    assert "no priority ordering" in reason
