"""`marsproxy serve` as a process: SIGTERM stops accepting, drains streams, exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@contextlib.asynccontextmanager
async def serve_process(worker_url: str, drain_s: float) -> AsyncIterator[tuple[Any, str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MARSPROXY_SERVER__DRAIN_TIMEOUT_S": str(drain_s)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "marsproxy.cli",
        "serve",
        "--port",
        str(port),
        "--worker",
        worker_url,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(400):  # the interpreter needs a moment to import and listen
                try:
                    async with http.get(base + "/healthz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
        yield proc, base
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigterm_lets_a_running_stream_finish(fake: Any) -> None:
    async with serve_process(fake.url, drain_s=10) as (proc, base), aiohttp.ClientSession() as http:
        async with http.post(
            base + "/v1/chat/completions", json=CHAT, headers={"x-fake": "slow"}
        ) as r:
            assert r.status == 200
            first = await r.content.readuntil(b"\n\n")
            proc.send_signal(signal.SIGTERM)
            rest = await r.content.read()
        text = (first + rest).decode()
        assert text.count('"content":"w') == 20 and text.endswith("data: [DONE]\n\n")
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        with pytest.raises(aiohttp.ClientConnectionError):  # nothing listens any more
            await http.get(base + "/healthz")
    assert fake.completed == 1 and fake.cancelled == 0


async def test_drain_timeout_cuts_streams_that_do_not_finish(fake: Any, until: Any) -> None:
    async with (
        serve_process(fake.url, drain_s=0.3) as (proc, base),
        aiohttp.ClientSession() as http,
    ):
        r = await http.post(base + "/v1/chat/completions", json=CHAT, headers={"x-fake": "stall"})
        await r.content.readuntil(b"\n\n")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        r.close()
    await until(lambda: fake.cancelled == 1)
