"""A gateway with one admission slot per worker (``window_min = window_max = 1``), and what the
failure-path tests read of it afterwards.

A call that fails must leave nothing behind: no request counted in flight (the worker's, the
dispatch gate's, the session table's), nobody queued, and a slot only for a session that goes
on. With one slot a leaked one also shows as the next new session held in the queue, so
:meth:`Rig.serves_next` checks it from the client's side too.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from marsproxy.config import MarsConfig
from marsproxy.gateway.http.app import Running

from .relay_client import CHAT, config, gateway, url

# Short periods: an ejection, a scrape and a control tick are a few tens of milliseconds away.
SECTIONS: dict[str, dict[str, Any]] = {
    "admission": {"window_init": 1, "window_min": 1, "window_max": 1,
                  "tuning": {"control_interval_s": 0.05}},
    "health": {"interval_s": 0.05, "timeout_s": 1.0, "unhealthy_after": 1, "healthy_after": 1},
    "probes": {"vllm": {"period_s": 0.05, "idle_period_s": 0.05, "timeout_s": 1.0},
               "nvml": {"enabled": False}},
}
WITHIN_S = 4.0  # a bound on each wait: a hang fails the test instead of stalling it


def one_slot(workers: list[Any], **sections: dict[str, Any]) -> MarsConfig:
    """The config: ``workers`` (URLs or worker tables), one slot each, ``sections`` merged in."""
    merged = {k: dict(v) for k, v in SECTIONS.items()}
    for k, v in sections.items():
        merged[k] = {**merged.get(k, {}), **v}
    return config(workers, **merged)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    text: str

    def error(self) -> dict[str, Any]:
        """The OpenAI-shaped error of a buffered reply."""
        assert self.headers.get("Content-Type", "").startswith("application/json"), self
        body = json.loads(self.text)
        assert set(body) == {"error"}, body
        assert {"message", "type", "code"} <= set(body["error"]), body
        return body["error"]  # type: ignore[no-any-return]

    def events(self) -> list[str]:
        return [e for e in self.text.replace("\r\n", "\n").split("\n\n") if e.strip()]

    def stream_error(self) -> dict[str, Any]:
        """The error event that ends a stream cut after its headers."""
        assert self.status == 200, self
        last = json.loads(self.events()[-1].removeprefix("data: "))
        assert set(last) == {"error"}, last
        return last["error"]  # type: ignore[no-any-return]


@dataclass
class Rig:
    g: Running
    http: aiohttp.ClientSession

    @classmethod
    async def start(cls, cfg: MarsConfig, http: aiohttp.ClientSession) -> Rig:
        return cls(await gateway(cfg), http)

    async def stop(self) -> None:
        await self.g.stop()

    async def call(self, session: str, *, final: bool = False, stream: bool = False,
                   headers: dict[str, str] | None = None) -> Reply:
        h = {"x-session-id": session, **(headers or {})}
        if final:
            h["x-session-final"] = "true"
        body = {**CHAT, "stream": stream}
        async with asyncio.timeout(WITHIN_S):
            async with self.http.post(url(self.g, "/v1/chat/completions"), json=body,
                                      headers=h) as r:
                return Reply(r.status, dict(r.headers), await r.text())

    async def state(self) -> dict[str, Any]:
        async with self.http.get(url(self.g, "/mars/v1/state")) as r:
            assert r.status == 200
            return await r.json()  # type: ignore[no-any-return]

    async def settled(self, *, holding: dict[str, list[str]] | None = None) -> dict[str, Any]:
        """Wait until no request is in flight or queued anywhere and the slots are exactly
        ``holding`` (worker label → the sessions that go on there; none by default)."""
        want = holding or {}
        last: dict[str, Any] = {}
        loop = asyncio.get_running_loop()
        end = loop.time() + WITHIN_S
        while True:
            st = await self.state()
            last = leftovers(st)
            if last == {"slots": {w: sorted(s) for w, s in want.items() if s}}:
                return st
            if loop.time() > end:
                raise AssertionError(f"left behind: {last}; wanted only slots {want}")
            await asyncio.sleep(0.02)

    async def serves_next(self, session: str = "next") -> Reply:
        """A new session's one call is served: no slot is held against it."""
        r = await self.call(session, final=True)
        assert r.status == 200, r
        await self.settled()
        return r


def leftovers(st: dict[str, Any]) -> dict[str, Any]:
    """What the state shows still taken: calls, queue entries, slots (only the non-empty)."""
    adm = st["admission"]
    q = adm["queue"]
    out: dict[str, Any] = {}
    counts = {
        "queued": q["length"] + q["pending"],
        "in_llm": st["sessions"]["by_state"]["llm"],
        "in_flight": sum(w["requests_in_flight"] for w in st["workers"]),
        "dispatched": sum(w["scheduler"]["in_flight"] for w in st["workers"]),
        "gated": sum(w["scheduler"]["queue_length"] for w in st["workers"]),
    }
    out.update({k: v for k, v in counts.items() if v})
    out["slots"] = {w: sorted(row["sessions"]) for w, row in adm["workers"].items()
                    if row["sessions"] or row["admitted"]}
    return out
