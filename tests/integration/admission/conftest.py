"""Emulated vLLM workers behind a gateway with a small, fixed admission window.

``window_init = window_min = window_max`` pins the limit, so what a test sees is the admission
queue and the session lifecycle, not the AIMD controller (the pure tests cover that). Polls
have bounded deadlines; nothing asserts on wall-clock time.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from marsproxy.aimd.config import AdmissionTuning
from marsproxy.config import load_config
from marsproxy.emulator.server import EmulatorOptions, create_app
from marsproxy.gateway.http.app import Running, start


async def _run(app: web.Application) -> tuple[web.AppRunner, str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner, f"http://127.0.0.1:{sock.getsockname()[1]}"


@dataclass
class Stack:
    proxy: Running
    http: aiohttp.ClientSession
    workers: list[tuple[web.AppRunner, str]] = field(default_factory=list)
    stopped: bool = False  # a test stopped the proxy itself

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.proxy.port}{path}"

    async def state(self) -> dict[str, Any]:
        async with self.http.get(self.url("/mars/v1/state")) as r:
            assert r.status == 200
            return await r.json()  # type: ignore[no-any-return]

    async def chat(
        self, session: str, *, final: bool = False, content: str = "hello there"
    ) -> tuple[int, dict[str, str], dict[str, Any]]:
        """One turn of ``session``: (status, headers, JSON body)."""
        headers = {"x-session-id": session}
        if final:
            headers["x-session-final"] = "true"
        body = {
            "model": "tiny-emulated",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4,
        }
        async with self.http.post(
            self.url("/v1/chat/completions"), json=body, headers=headers
        ) as r:
            return r.status, dict(r.headers), await r.json()

    async def queue_length(self) -> int:
        q = (await self.state())["admission"]["queue"]
        return int(q["length"]) + int(q["pending"])

    async def admitted(self) -> int:
        workers = (await self.state())["admission"]["workers"]
        return sum(int(w["admitted"]) for w in workers.values())

    async def until(self, cond: Callable[[], Awaitable[bool]], within: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        while not await cond():
            if loop.time() > end:
                raise AssertionError("condition never held")
            await asyncio.sleep(0.02)


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def make_stack() -> AsyncIterator[StackFactory]:
    """``await make_stack(workers=n, window=w, store={...}, app=factory, **admission)``
    (admission keys of both levels: the tuning ones go under ``admission.tuning``);
    ``share=stack`` puts a second gateway (a replica) in front of that stack's workers;
    ``cpu={...}`` overrides ``probes.cpu``, ``vllm={...}`` ``probes.vllm``."""
    made: list[Stack] = []
    http = aiohttp.ClientSession()

    async def make(
        workers: int = 1, window: int = 1, store: dict[str, Any] | None = None,
        app: Callable[[], web.Application] | None = None, share: Stack | None = None,
        cpu: dict[str, Any] | None = None, vllm: dict[str, Any] | None = None,
        **admission: Any
    ) -> Stack:
        build = app or (lambda: create_app(EmulatorOptions(profile="tiny", time_scale=0.05)))
        if share is not None:
            urls = [u for _, u in share.workers]
            emus: list[tuple[web.AppRunner, str]] = []
        else:
            emus = [await _run(build()) for _ in range(workers)]
            urls = [u for _, u in emus]
        tuning_keys = AdmissionTuning.model_fields  # tuning keys go under admission.tuning
        cfg = load_config(
            None,
            environ={},
            overrides={
                "workers": [{"url": u, "name": f"w{i}"} for i, u in enumerate(urls)],
                "server": {"port": 0},
                "health": {"interval_s": 0.1, "timeout_s": 0.5},
                "probes": {
                    "vllm": {"period_s": 0.05, "idle_period_s": 0.05, "timeout_s": 0.2,
                             "stale_after_s": 0.5} | (vllm or {}),
                    "nvml": {"enabled": False},
                    "cpu": {"period_s": 0.1} | (cpu or {}),
                },
                "admission": {
                    "window_init": window, "window_min": window, "window_max": window,
                    **{k: v for k, v in admission.items() if k not in tuning_keys},
                    "tuning": {"control_interval_s": 0.05}
                    | {k: v for k, v in admission.items() if k in tuning_keys},
                },
                "store": store or {},
            },
        )
        stack = Stack(await start(cfg), http, emus)
        made.append(stack)
        return stack

    yield make
    for s in made:
        if not s.stopped:
            await s.proxy.stop()
        for runner, _ in s.workers:
            await runner.cleanup()
    await http.close()
