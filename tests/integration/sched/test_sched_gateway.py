"""The scheduler in the gateway, against emulated vLLM workers.

- priority mode: the session order goes in the body's ``priority``; on a worker run with
  ``--scheduling-policy priority`` continuations of earlier sessions overtake a new session's
  long cold prefill that arrived before them (completion order), and without the proxy's
  order they do not;
- gated mode: the same order through the proxy's own dispatch queue on a FCFS worker;
- retention: under KV pressure a retained session's prefix stays warm across a short tool
  phase (cached tokens on return; a new session waits for admission meanwhile), and not
  across a long one (not retained; the new session is admitted and evicts it);
- ``priority: auto``: the start-up probe reads both emulator policies right.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.config import load_config
from marsproxy.emulator.server import EmulatorOptions, create_app
from marsproxy.gateway.http.app import Running, start

MODEL = "tiny-emulated"


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner, f"http://127.0.0.1:{sock.getsockname()[1]}"


@asynccontextmanager
async def stack(
    emu: EmulatorOptions, worker: dict[str, Any], policy: str = "mars-no-admission",
    **sections: Any,
) -> AsyncIterator[tuple[Running, aiohttp.ClientSession, str]]:
    wrunner, wurl = await _serve(create_app(emu))
    cfg = load_config(environ={}, overrides={
        "policy": policy,
        "server": {"port": 0},
        "workers": [{"url": wurl, "name": "w0", **worker}],
        "probes": {"nvml": {"enabled": False}},
        **sections,
    })
    proxy = await start(cfg)
    http = aiohttp.ClientSession()
    try:
        yield proxy, http, f"http://127.0.0.1:{proxy.port}"
    finally:
        await http.close()
        await proxy.stop()
        await wrunner.cleanup()


async def complete(
    http: aiohttp.ClientSession, base: str, session: str, prompt: str, max_tokens: int,
    done: list[str] | None = None,
) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    async with http.post(f"{base}/v1/completions", json=body,
                         headers={"x-session-id": session}) as r:
        assert r.status == 200, await r.text()
        out: dict[str, Any] = await r.json()
    if done is not None:
        done.append(session)
    return out


async def overtake_order(
    mode: Literal["priority", "gated"], policy: str, http: aiohttp.ClientSession, base: str
) -> list[str]:
    """A blocker holds the worker's only slot; a long cold prefill arrives, then three short
    continuations of sessions that ran before. Returns the completion order."""
    done: list[str] = []
    for i in range(3):  # earlier turns: these sessions are continuing, not new
        await complete(http, base, f"short{i}", f"short session {i} " * 8, 1)
    blocker = asyncio.create_task(complete(http, base, "blocker", "b" * 40, 1000, done))
    await asyncio.sleep(0.1)
    long = asyncio.create_task(complete(http, base, "long", "L" * 4 * 6000, 1, done))
    await asyncio.sleep(0.1)
    shorts = [asyncio.create_task(
        complete(http, base, f"short{i}", f"short session {i} " * 8 + "more", 2, done))
        for i in range(3)]
    await asyncio.gather(blocker, long, *shorts)
    return done


async def test_priority_mode_earlier_sessions_overtake_a_new_sessions_long_prefill() -> None:
    emu = EmulatorOptions(scheduling_policy="priority", max_num_seqs=1)
    async with stack(emu, {"priority": True}) as (_, http, base):
        order = await overtake_order("priority", "mars", http, base)
    assert order[0] == "blocker"
    assert order[-1] == "long", order  # all three shorts went first
    # The same engine and traffic without the proxy's order (fcfs preset): arrival order.
    async with stack(emu, {"priority": True}, policy="fcfs") as (_, http, base):
        order = await overtake_order("priority", "fcfs", http, base)
    assert order[:2] == ["blocker", "long"], order


async def test_gated_mode_orders_through_the_proxy_queue() -> None:
    emu = EmulatorOptions(scheduling_policy="fcfs", max_num_seqs=1)
    async with stack(emu, {"priority": False, "max_num_seqs": 1}) as (_, http, base):
        seen: list[dict[str, Any]] = []

        async def watch() -> None:
            while True:
                async with http.get(f"{base}/mars/v1/state") as r:
                    seen.append((await r.json())["workers"][0]["scheduler"])
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        order = await overtake_order("gated", "mars", http, base)
        watcher.cancel()
    assert order[0] == "blocker" and order[-1] == "long", order
    full = [s for s in seen if s["queue_length"] == 4]
    assert full, "the state never showed the four held continuations"
    assert full[-1]["mode"] == "gated" and full[-1]["cap"] == 1
    assert [q["priority"] for q in full[-1]["queue"]] == [0, 1, 2, 4]  # session order
    assert full[-1]["queue"][-1]["session"] == "long"
    # Without a cap (vLLM's default max_num_seqs) nothing is held: the worker's FCFS order.
    async with stack(emu, {"priority": False}) as (_, http, base):
        order = await overtake_order("gated", "mars", http, base)
    assert order[:2] == ["blocker", "long"], order


async def test_priority_mode_puts_the_order_in_the_body_and_hints_in_headers() -> None:
    emu = EmulatorOptions(scheduling_policy="priority")
    async with stack(emu, {"priority": True}) as (proxy, http, base):
        async with http.get(f"{base}/mars/v1/events?format=ndjson") as ev:
            await complete(http, base, "first", "x" * 40, 1)
            await complete(http, base, "s", "x" * 4 * 3000, 1)
            dispatched: list[bytes] = []
            while len(dispatched) < 2:
                line = await ev.content.readline()
                if b'"dispatch"' in line:
                    dispatched.append(line)
        doc = __import__("json").loads(dispatched[1])
        # The second session goes after the first: its arrival number is the body's priority.
        assert doc["level"] is None and doc["priority"] == 1 and doc["mode"] == "priority"
        assert doc["hint"] == "priority=1 headers" and doc["worker"] == "w0"
        st = proxy.gateway.scheduler.core
        assert st.modes["w0"] == "priority" and not any(st.levels_total.values())


async def chat(
    http: aiohttp.ClientSession, base: str, session: str, content: str, *, final: bool = False
) -> dict[str, Any]:
    headers = {"x-session-id": session}
    if final:
        headers["x-session-final"] = "true"
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "ignore_eos": True}
    async with http.post(f"{base}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.json()  # type: ignore[no-any-return]


async def tool_history(
    http: aiohttp.ClientSession, base: str, session: str, tool: str, seconds: float
) -> None:
    """Report one past tool phase of ``seconds`` (explicit events carry their own ts)."""
    now = time.time()
    for kind, ts in (("tool_start", now - seconds), ("tool_end", now)):
        async with http.post(f"{base}/mars/v1/sessions/{session}/events",
                             json={"type": kind, "tool": tool, "ts": ts}) as r:
            assert r.status == 202, await r.text()


async def test_retention_keeps_a_prefix_warm_across_a_short_tool_phase_only() -> None:
    # 256 blocks of 16 = 4096 tokens; sessions of ~2000 tokens, a newcomer of ~3400 tokens:
    # the newcomer fits only by evicting a dormant session's prefix. Continuum-style fixed
    # retention (3 s for tools usually done within 3 s) makes the decision independent of the
    # emulator's (very fast) prefill; the mars rule itself is covered by the pure tests.
    emu = EmulatorOptions(num_blocks=256)
    async with stack(
        emu, {}, policy="mars",
        scheduler={"retention_policy": "fixed", "tuning": {"fixed_retention_s": 3.0}},
        admission={"window_init": 8, "window_min": 8, "window_max": 8},
    ) as (proxy, http, base):
        context = "a" * 4 * 2000
        await chat(http, base, "A", "hi")
        await tool_history(http, base, "A", "grep", 0.2)  # usual tool: quick
        await chat(http, base, "A", context)
        sched = proxy.gateway.scheduler.core
        assert [r.session for r in sched.ledger.reservations()] == [f"{_tenant()}/id/A"]
        # The ledger reaches the admission budget at its next control tick (0.2 s).
        await asyncio.sleep(0.3)
        newcomer = asyncio.create_task(chat(http, base, "B", "b" * 4 * 3400, final=True))
        await asyncio.sleep(0.5)
        assert not newcomer.done(), "the newcomer was admitted into the retained room"
        back = await chat(http, base, "A", context + " and the tool said ok", final=True)
        cached = back["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 1900, back["usage"]
        await asyncio.wait_for(newcomer, 10)

        # Now a session whose tools usually take 10 s: not retained, so the newcomer goes at
        # once and its prefix is evicted.
        other = "c" * 4 * 2000
        await chat(http, base, "C", "hi")
        await tool_history(http, base, "C", "pytest", 10.0)
        await chat(http, base, "C", other)
        assert sched.ledger.reservation(f"{_tenant()}/id/C") is None
        await asyncio.wait_for(chat(http, base, "B2", "d" * 4 * 3400, final=True), 5)
        back = await chat(http, base, "C", other + " and pytest passed", final=True)
        assert back["usage"]["prompt_tokens_details"]["cached_tokens"] < 1000, back["usage"]
        async with http.get(f"{base}/metrics") as r:
            text = await r.text()
    resumes = {
        (x.labels["outcome"], x.labels["retained"]): x.value
        for fam in text_string_to_metric_families(text) for x in fam.samples
        if x.name == "marsproxy_resumes_total"
    }
    # A's return was warm and retained; C's was cold and not retained (the first, tiny turns
    # of A and C count as cold resumes too: one prompt block is never cached).
    assert resumes[("warm", "true")] == 1
    assert resumes[("cold", "false")] >= 1
    assert resumes.get(("cold", "true"), 0) == 0  # the series exists from the start, at 0


def _tenant() -> str:
    from marsproxy.core.identity import tenant_of

    return tenant_of(None)


async def test_auto_probe_reads_both_emulator_policies() -> None:
    for policy, expect in (("priority", "priority"), ("fcfs", "gated")):
        # 5x slower than modelled: its prefill chunks last long enough to queue B and C behind A
        emu = EmulatorOptions(scheduling_policy=policy, time_scale=5.0)  # type: ignore[arg-type]
        async with stack(emu, {"priority": "auto"}) as (proxy, http, base):
            shell = proxy.gateway.scheduler
            for _ in range(200):
                if not shell.mode_reason["w0"].startswith("auto: probe pending"):
                    break
                await asyncio.sleep(0.05)
            async with http.get(f"{base}/mars/v1/state") as r:
                w = (await r.json())["workers"][0]["scheduler"]
        assert w["mode"] == expect, w["mode_reason"]
        assert w["mode_reason"].startswith("auto: ")


async def test_a_call_that_fails_after_its_ticket_frees_the_gate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call whose scheduling fails after its ticket was dispatched (a bug in the hints' step)
    gets its error, and its ticket leaves the gate: with a cap of one, a leaked ticket would
    hold every later call of the worker in the gated queue for good."""
    emu = EmulatorOptions(scheduling_policy="fcfs", max_num_seqs=1)
    async with stack(emu, {"priority": False, "max_num_seqs": 1}) as (proxy, http, base):
        shell = proxy.gateway.scheduler
        real = shell._hints

        def fails_once(*args: Any, **kw: Any) -> Any:
            monkeypatch.setattr(shell, "_hints", real)
            raise RuntimeError("a bug in the hints")

        monkeypatch.setattr(shell, "_hints", fails_once)
        body = {"model": MODEL, "prompt": "x" * 40, "max_tokens": 1}
        async with http.post(f"{base}/v1/completions", json=body,
                             headers={"x-session-id": "odd"}) as r:
            assert r.status == 500 and (await r.json())["error"]["type"], await r.text()
        core = shell.core
        assert core.in_flight("w0") == 0 and core.queue_length("w0") == 0
        out = await asyncio.wait_for(complete(http, base, "next", "x" * 40, 1), 10)
        assert out["choices"]
