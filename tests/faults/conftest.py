"""Fault tests: real processes (``marsproxy serve``, ``marsproxy emulate``, a private
redis-server) on loopback, killed, paused and slowed on purpose.

Every wait is a bounded poll that fails with what it was waiting for and the last value seen;
the proxies' logs (in the test's tmp_path) are printed when a test fails.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import redis
import yaml

from marsproxy.bench.procs import RedisServer, Service

T = TypeVar("T")

# Short everything: a fault is noticed within about a second.
BASE_CONFIG: dict[str, Any] = {
    "server": {"drain_timeout_s": 2.0, "log_level": "info"},
    "health": {"interval_s": 0.2, "timeout_s": 0.3, "unhealthy_after": 2, "healthy_after": 1},
    "upstream": {"connect_timeout_s": 0.5, "first_byte_timeout_s": 2.0, "idle_timeout_s": 1.0},
    "probes": {
        "vllm": {"period_s": 0.1, "idle_period_s": 0.1, "timeout_s": 0.3,
                 "stale_after_s": 1.0},
        "nvml": {"enabled": False},
        "cpu": {"tool_cpus": 256},  # the tests' "tools" are sleeps: never CPU-bound
    },
    "admission": {"queue_deadline_s": 20.0,
                  "tuning": {"control_interval_s": 0.1, "aging_margin_s": 1.0}},
}


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


async def until(
    probe: Callable[[], Awaitable[T]], ok: Callable[[T], bool], what: str, timeout_s: float
) -> T:
    """Poll ``probe`` until ``ok``; fail after ``timeout_s`` saying what and the last value."""
    last: Any = None
    deadline = time.monotonic() + timeout_s
    while True:
        last = await probe()
        if ok(last):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s; last seen: {last!r}")
        await asyncio.sleep(0.05)


async def bounded(aw: Awaitable[T], timeout_s: float, what: str) -> T:
    """``aw`` within ``timeout_s``, else a failure naming what hung."""
    try:
        async with asyncio.timeout(timeout_s):
            return await aw
    except TimeoutError:
        raise AssertionError(f"{what}: still running after {timeout_s} s (hang)") from None


@dataclass
class Proxy:
    svc: Service
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.svc.url

    async def state(self, sessions: bool = False) -> dict[str, Any]:
        q = "?sessions=1&limit=1000" if sessions else ""
        async with self.http.get(f"{self.url}/mars/v1/state{q}") as r:
            assert r.status == 200, await r.text()
            return await r.json()  # type: ignore[no-any-return]

    async def metric(self, name: str) -> float:
        async with self.http.get(f"{self.url}/metrics") as r:
            text = await r.text()
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not in the proxy's /metrics")

    async def admitted(self) -> dict[str, int]:
        """This replica's admitted sessions (pending included) per worker."""
        st = await self.state()
        return {w: row["admitted"] for w, row in st["admission"]["workers"].items()}

    async def held_sessions(self) -> dict[str, set[str]]:
        st = await self.state()
        return {w: set(row["sessions"]) for w, row in st["admission"]["workers"].items()}

    async def worker_of(self, session: str) -> str:
        st = await self.state(sessions=True)
        for row in st["sessions"]["details"]:
            if row["id"] == session:
                return str(row["worker"])
        raise AssertionError(f"session {session!r} not in the proxy's table")


def chat_body(session: str, *, tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "tiny-emulated",
        "max_tokens": tokens,
        "ignore_eos": True,  # the emulator then generates exactly `tokens` tokens
        "stream": stream,
        "messages": [{"role": "user", "content": f"work for {session}"}],
    }


def headers(session: str, final: bool = False, cls: str | None = None) -> dict[str, str]:
    h = {"x-session-id": session}
    if final:
        h["x-session-final"] = "true"
    if cls is not None:
        h["x-session-class"] = cls
    return h


@dataclass
class Reply:
    status: int
    body: str
    headers: dict[str, str]

    def json(self) -> dict[str, Any]:
        return json.loads(self.body)  # type: ignore[no-any-return]


async def call(
    http: aiohttp.ClientSession, base: str, session: str, *, tokens: int = 4,
    stream: bool = False, final: bool = False, cls: str | None = None,
) -> Reply:
    async with http.post(
        f"{base}/v1/chat/completions", json=chat_body(session, tokens=tokens, stream=stream),
        headers=headers(session, final, cls),
    ) as r:
        return Reply(r.status, await r.text(), dict(r.headers))


@dataclass
class Load:
    """Agents that keep starting sessions (``turns`` calls, the last final) until stopped; a
    session refused at a call is over for its client, which starts a new one (after
    ``pause_after_refusal_s``). ``outcomes``: (status, error code) per call of each session."""

    turns: int
    pause_after_refusal_s: float = 0.0
    outcomes: list[list[tuple[int, str]]] = field(default_factory=list)
    refused_at: list[float] = field(default_factory=list)  # monotonic
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def agent(self, p: Proxy, name: str) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            session, calls = f"{name}-{n}", []
            self.outcomes.append(calls)
            for t in range(self.turns):
                r = await call(p.http, p.url, session, final=t == self.turns - 1)
                calls.append((r.status, r.json()["error"]["code"] if r.status != 200 else ""))
                if r.status != 200:
                    self.refused_at.append(time.monotonic())
                    await asyncio.sleep(self.pause_after_refusal_s)
                    break
                await asyncio.sleep(0.1)  # its "tool"


async def emulator_gauge(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Lab:
    """Processes of one test; everything is stopped (and Redis deleted) at the end."""

    tmp: Path
    http: aiohttp.ClientSession
    services: list[Service] = field(default_factory=list)
    redis_servers: list[RedisServer] = field(default_factory=list)

    def emulator(
        self, name: str, *, profile: str = "tiny", time_scale: float = 1.0,
        extra: tuple[str, ...] = (),
    ) -> Service:
        svc = Service.emulator(self.tmp, name, profile=profile, time_scale=time_scale,
                               extra=extra)
        self.services.append(svc)
        return svc.start()

    def config(self, workers: dict[str, Service], over: dict[str, Any]) -> Path:
        cfg = merged(BASE_CONFIG, over)
        cfg["workers"] = [{"url": s.url, "name": n} for n, s in workers.items()]
        path = self.tmp / f"proxy-{len(self.services)}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def proxy(self, config: Path, name: str = "proxy") -> Proxy:
        svc = Service.proxy(self.tmp, f"{name}-{len(self.services)}", config)
        self.services.append(svc)
        return Proxy(svc.start(), self.http)

    def redis(self, *, host: str = "127.0.0.1", extra: tuple[str, ...] = ()) -> RedisServer:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        server = RedisServer(self.tmp, host=host, extra=extra)
        server.start()
        self.redis_servers.append(server)
        return server

    def close(self) -> None:
        for s in self.services:
            s.stop(timeout_s=5)
        for r in self.redis_servers:
            r.kill()

    def logs(self) -> str:
        proxies = [s for s in self.services if "serve" in s.args]
        return "\n".join(f"--- {s.log_path.name}\n{s.log_tail()}" for s in proxies)


@pytest.fixture
async def lab(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Lab]:
    timeout = aiohttp.ClientTimeout(total=30)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        lab = Lab(tmp_path, http)
        try:
            yield lab
        finally:
            await asyncio.to_thread(lab.close)
            rep = getattr(request.node, "rep_call", None)
            if rep is not None and rep.failed:
                print(lab.logs())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    rep = yield
    if rep.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]
    return rep


def redis_leases(url: str, pool: str, workers: list[str]) -> dict[str, dict[str, str]]:
    """Live leases in the store per worker: session → owning replica id."""
    r = redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=1)
    try:
        now_ms = time.time_ns() // 1_000_000
        out: dict[str, dict[str, str]] = {}
        for w in workers:
            live = r.zrangebyscore(f"mars:{{{pool}}}:adm:{w}", f"({now_ms}", "+inf")
            owners = r.hgetall(f"mars:{{{pool}}}:own:{w}")
            out[w] = {s: owners.get(s, "?") for s in live}
        return out
    finally:
        r.close()
