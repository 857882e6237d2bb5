"""A live proxy for the hostile-input tests: two emulated vLLM workers and the proxy, served
on loopback by an event loop in a background thread, so that synchronous clients (httpx,
raw sockets, hypothesis, schemathesis) can hit it while it keeps serving.

``make_live(overrides)`` starts one with extra config; ``TOKEN`` is the admin token every
stack has. Nothing is mocked: real sockets, real aiohttp, the real emulator.

Admission is off here: every fuzz request that succeeds starts a session, and admitted sessions
hold their slot for at least ``admission.idle_timeout_min_s``, so hundreds of one-shot examples
would fill the window and queue the rest (a real limit of sharing one window among tenants;
docs/security.md). Admission has its own suites.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import pytest
from aiohttp import web

from marsproxy.config import MarsConfig, load_config
from marsproxy.emulator.server import EmulatorOptions, create_app
from marsproxy.gateway.http.app import Running, start

TOKEN = "adm-Tok3n-for-tests"
T = TypeVar("T")


def _deep(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass
class Live:
    url: str
    host: str
    port: int
    cfg: MarsConfig
    running: Running
    loop: asyncio.AbstractEventLoop
    http: httpx.Client
    admin: dict[str, str] = field(default_factory=lambda: {"Authorization": f"Bearer {TOKEN}"})
    token: str = TOKEN

    @staticmethod
    def status(raw: bytes) -> int:
        return status_of(raw)

    def on_loop(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the proxy's loop (its state is not thread-safe) and return its result."""
        fut: Future[T] = Future()

        def call() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        self.loop.call_soon_threadsafe(call)
        return fut.result(timeout=10)

    def raw(self, data: bytes, *, read_timeout_s: float = 5.0) -> bytes:
        """Send raw bytes on a fresh connection; everything the proxy sent back until it closed
        the connection or went quiet for ``read_timeout_s``."""
        with socket.create_connection((self.host, self.port), timeout=read_timeout_s) as s:
            s.sendall(data)
            got = b""
            try:
                while chunk := s.recv(65536):
                    got += chunk
                    if _complete(got):
                        break
            except (TimeoutError, ConnectionResetError):
                pass
            return got

    def chat(self, session: str, key: str = "sk-tenant-a", **extra: Any) -> httpx.Response:
        body = {
            "model": "tiny-emulated",
            "messages": [{"role": "user", "content": f"hello from {session}"}],
            "max_tokens": 4,
            **extra,
        }
        return self.http.post(
            "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}", "x-session-id": session},
        )

    def session_turns(self, session: str) -> int | None:
        doc = self.http.get("/mars/v1/state?sessions=1&limit=1000", headers=self.admin).json()
        for d in doc["sessions"].get("details", []):
            if d["id"] == session:
                return int(d["turns"])
        return None


def _complete(got: bytes) -> bool:
    """A whole response with a Content-Length body is in ``got``."""
    head, sep, body = got.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return False


def status_of(raw: bytes) -> int:
    """The status code of a raw HTTP response (0: none came)."""
    parts = raw.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[0].startswith(b"HTTP/") else 0


class _Stack:
    def __init__(self, overrides: dict[str, Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.overrides = overrides
        self.workers: list[web.AppRunner] = []
        self.running: Running | None = None

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> tuple[Running, MarsConfig]:
        urls = []
        for _ in range(2):
            app = create_app(EmulatorOptions(profile="tiny", time_scale=0.01))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.workers.append(runner)
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
        base = {
            "workers": urls,
            "server": {"port": 0},
            "auth": {"admin_token": TOKEN},
            # Tolerant health checks: a loaded CI machine must not eject a live worker.
            "health": {"interval_s": 0.5, "timeout_s": 5.0, "unhealthy_after": 3},
            "probes": {"nvml": {"enabled": False}, "vllm": {"period_s": 0.1}},
            "admission": {"enabled": False},
        }
        cfg = load_config(None, environ={}, overrides=_deep(base, self.overrides))
        return await start(cfg), cfg

    async def _stop(self) -> None:
        if self.running is not None:
            await self.running.stop()
        for w in self.workers:
            await w.cleanup()

    def __enter__(self) -> Live:
        self.running, cfg = self.run(self._start())
        url = f"http://127.0.0.1:{self.running.port}"
        self.http = httpx.Client(base_url=url, timeout=30.0)
        return Live(url, "127.0.0.1", self.running.port, cfg, self.running, self.loop, self.http)

    def __exit__(self, *exc: object) -> None:
        self.http.close()
        try:
            self.run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self.loop.close()


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    """One stack with the default caps (and the admin token), shared by a module's tests."""
    with _Stack({}) as stack:
        yield stack


@pytest.fixture
def make_live() -> Iterator[Callable[[dict[str, Any]], Live]]:
    """``make_live(overrides)``: a stack with its own config, stopped after the test."""
    stacks: list[_Stack] = []

    def make(overrides: dict[str, Any]) -> Live:
        st = _Stack(overrides)
        stacks.append(st)
        return st.__enter__()

    yield make
    for st in stacks:
        st.__exit__(None, None, None)
