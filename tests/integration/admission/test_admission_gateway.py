"""Admission end to end: the gateway holds, admits, refuses and frees sessions.

Emulated vLLM workers on real sockets; the window is pinned small (see conftest). Every wait
is a bounded poll; no assertion is on wall-clock time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiohttp import web

from marsproxy.aimd.stores import MemoryStore, WindowRecord, wall_clock_ms
from marsproxy.core.events import SessionEnd, SessionQueued

_Factory = Any


async def test_burst_waits_then_is_admitted_as_sessions_end(make_stack: _Factory) -> None:
    s = await make_stack(workers=2, window=2)  # 4 sessions at a time in all
    queued = s.proxy.gateway.telemetry.bus.subscribe(lambda e: isinstance(e, SessionQueued))
    tasks = {f"b{i}": asyncio.create_task(s.chat(f"b{i}")) for i in range(7)}
    await s.until(lambda: _done(tasks, 4))
    await s.until(lambda: _eq(s.queue_length(), 3))
    assert await s.admitted() == 4
    assert sum(1 for t in tasks.values() if t.done()) == 4  # the other three are held
    assert all(t.result()[0] == 200 for t in tasks.values() if t.done())
    state = await s.state()
    assert all(w["admitted"] <= 2 for w in state["admission"]["workers"].values())
    assert len(state["admission"]["queue"]["order"]) == 3
    events = queued.poll()
    assert len({e.session for e in events}) == 7  # every new session queues first
    # Stamped in wall time like every other event, not the core's monotonic clock.
    assert all(abs(e.ts - time.time()) < 60 for e in events)

    # Each final turn ends a session and lets exactly one waiter in.
    for expected in (5, 6, 7):
        first = next(k for k, t in tasks.items() if t.done() and not k.endswith("-done"))
        status, _, _ = await s.chat(first, final=True)
        assert status == 200
        tasks[first + "-done"] = tasks.pop(first)
        await s.until(lambda n=expected: _done(tasks, n))  # type: ignore[misc]
        assert await s.admitted() <= 4
    assert all(t.result()[0] == 200 for t in tasks.values())
    await s.until(lambda: _eq(s.queue_length(), 0))


async def test_queue_full_is_429_with_retry_after(make_stack: _Factory) -> None:
    s = await make_stack(window=1, queue_max=1)
    assert (await s.chat("holder"))[0] == 200  # holds the only slot across its tool phase
    waiter = asyncio.create_task(s.chat("waiter"))
    await s.until(lambda: _eq(s.queue_length(), 1))
    status, headers, body = await s.chat("one-too-many")
    assert status == 429
    assert int(headers["Retry-After"]) >= 1
    assert body["error"]["code"] == "queue_full" and body["error"]["type"] == "rate_limit_error"
    assert headers["x-marsproxy-reason"] == "queue_full"
    async with s.http.get(s.url("/metrics")) as r:
        text = await r.text()
    assert 'marsproxy_rejections_total{reason="queue_full"} 1.0' in text
    assert (await s.chat("holder", final=True))[0] == 200
    assert (await asyncio.wait_for(waiter, 10))[0] == 200


async def test_queue_deadline_is_503_with_retry_after(make_stack: _Factory) -> None:
    s = await make_stack(window=1, queue_deadline_s=0.3, aging_margin_s=0.1)
    assert (await s.chat("holder"))[0] == 200
    status, headers, body = await asyncio.wait_for(s.chat("late"), 10)
    assert status == 503
    assert int(headers["Retry-After"]) >= 1
    assert body["error"]["code"] == headers["x-marsproxy-reason"] == "queue_deadline"
    assert await s.queue_length() == 0
    assert (await s.chat("holder"))[0] == 200  # the holder's continuations still go through


async def test_idle_session_times_out_and_frees_its_slot(make_stack: _Factory) -> None:
    s = await make_stack(window=1, idle_timeout_min_s=0.2, idle_timeout_max_s=0.4)
    ends = s.proxy.gateway.telemetry.bus.subscribe(lambda e: isinstance(e, SessionEnd))
    assert (await s.chat("sleepy"))[0] == 200  # then never comes back
    assert (await asyncio.wait_for(s.chat("next"), 10))[0] == 200
    idle = [e for e in ends.poll() if e.session and e.session.endswith("/sleepy")]
    assert [(e.reason, e.worker) for e in idle] == [("idle_timeout", "w0")]
    state = await s.state()
    assert state["admission"]["workers"]["w0"]["sessions"] == ["next"]


async def test_delete_frees_the_slot_and_a_gone_waiter_leaves_the_queue(
    make_stack: _Factory,
) -> None:
    s = await make_stack(window=1)
    assert (await s.chat("first"))[0] == 200
    # A waiting client that goes away leaves the queue.
    quitter = asyncio.create_task(s.chat("quitter"))
    await s.until(lambda: _eq(s.queue_length(), 1))
    quitter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await quitter
    await s.until(lambda: _eq(s.queue_length(), 0))
    waiter = asyncio.create_task(s.chat("second"))
    await s.until(lambda: _eq(s.queue_length(), 1))
    async with s.http.delete(s.url("/mars/v1/sessions/first")) as r:
        assert r.status == 200
    assert (await asyncio.wait_for(waiter, 10))[0] == 200
    assert (await s.state())["admission"]["workers"]["w0"]["sessions"] == ["second"]


async def test_continuations_are_never_held(make_stack: _Factory) -> None:
    s = await make_stack(window=1)
    assert (await s.chat("agent"))[0] == 200
    waiter = asyncio.create_task(s.chat("blocked"))
    await s.until(lambda: _eq(s.queue_length(), 1))
    for _ in range(3):  # the window is full of others, yet the admitted session goes on
        assert (await asyncio.wait_for(s.chat("agent"), 10))[0] == 200
    assert not waiter.done()
    assert (await s.chat("agent", final=True))[0] == 200
    assert (await asyncio.wait_for(waiter, 10))[0] == 200


async def test_leases_are_renewed_while_the_session_lives(make_stack: _Factory) -> None:
    s = await make_stack(window=1, store={"lease_ttl_s": 0.3, "heartbeat_interval_s": 0.1})
    assert (await s.chat("long-lived"))[0] == 200
    waiter = asyncio.create_task(s.chat("patient"))
    await s.until(lambda: _eq(s.queue_length(), 1))
    # Many lease TTLs later the slot is still the first session's (heartbeats renew it).
    for _ in range(10):
        await asyncio.sleep(0.1)
        row = (await s.state())["admission"]["workers"]["w0"]
        assert row["admitted_store"] == 1 and row["sessions"] == ["long-lived"]
    assert not waiter.done()
    assert (await s.chat("long-lived", final=True))[0] == 200
    assert (await asyncio.wait_for(waiter, 10))[0] == 200


async def test_one_replica_admits_what_the_plane_decides(make_stack: _Factory) -> None:
    # The in-memory store serves one replica: the plane is the only arbiter (as in the
    # simulator), so a store whose last published window says 0 holds nobody back, and the
    # store keeps the lease for as long as the session lives.
    s = await make_stack(window=2, control_interval_s=1000.0)
    adm = s.proxy.gateway.admission
    assert adm is not None and isinstance(adm.store, MemoryStore)
    store = adm.store
    store.set_windows({"w0": WindowRecord(0, 0, wall_clock_ms(), idle_limit=0)})
    adm._windows = await store.read_windows()
    assert (await asyncio.wait_for(s.chat("a"), 10))[0] == 200
    row = (await s.state())["admission"]["workers"]["w0"]
    assert row["sessions"] == ["a"] and store.admitted_counts_sync(["w0"]) == {"w0": 1}
    assert (await asyncio.wait_for(s.chat("a", final=True), 10))[0] == 200
    assert store.admitted_counts_sync(["w0"]) == {"w0": 0}


async def test_a_stalled_event_loop_ends_no_session(make_stack: _Factory) -> None:
    # One replica: its leases outlive a stall longer than their TTL (the heartbeat could not
    # run); with several, that is when another replica may take a session over.
    s = await make_stack(window=2, store={"lease_ttl_s": 0.3, "heartbeat_interval_s": 0.1})
    assert (await s.chat("a"))[0] == 200
    time.sleep(0.6)  # noqa: ASYNC251 - the stall itself: no heartbeat for twice the TTL
    await asyncio.sleep(0.4)  # heartbeats and control ticks run again
    row = (await s.state())["admission"]["workers"]["w0"]
    assert row["sessions"] == ["a"] and row["admitted_store"] == 1


def _plain_worker() -> web.Application:
    """An OpenAI-compatible upstream that is not vLLM: /health and chat, no /metrics."""

    async def chat(_: web.Request) -> web.Response:
        return web.json_response({
            "id": "c", "object": "chat.completion", "model": "plain",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        })

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_worker_without_metrics_still_admits_at_window_min(make_stack: _Factory) -> None:
    s = await make_stack(window=3, window_min=1, app=_plain_worker)
    assert (await asyncio.wait_for(s.chat("one"), 10))[0] == 200  # not stuck as "stale"
    waiter = asyncio.create_task(s.chat("two"))
    await s.until(lambda: _eq(s.queue_length(), 1))  # unknown KV reads as full: limit 1
    row = (await s.state())["admission"]["workers"]["w0"]
    assert row["limit"] == 1 and row["stale"] is True and row["kv_overloaded"] is True
    assert (await s.chat("one", final=True))[0] == 200
    assert (await asyncio.wait_for(waiter, 10))[0] == 200


async def test_shutdown_answers_held_requests_at_once(make_stack: _Factory) -> None:
    s = await make_stack(window=1)
    assert (await s.chat("holder"))[0] == 200
    waiter = asyncio.create_task(s.chat("held"))
    await s.until(lambda: _eq(s.queue_length(), 1))
    stopping = asyncio.create_task(s.proxy.stop())
    status, headers, body = await asyncio.wait_for(waiter, 10)  # not after the drain timeout
    assert status == 503 and body["error"]["code"] == "shutting_down"
    assert int(headers["Retry-After"]) >= 1
    await asyncio.wait_for(stopping, 10)
    s.stopped = True


async def test_state_and_metrics_show_admission(make_stack: _Factory) -> None:
    s = await make_stack(workers=2, window=3)
    assert (await s.chat("m1"))[0] == 200
    adm = (await s.state())["admission"]
    assert set(adm["workers"]) == {"w0", "w1"}
    row = adm["workers"]["w0"] if adm["workers"]["w0"]["admitted"] else adm["workers"]["w1"]
    assert row["admitted"] == 1 and row["limit"] == 3 and row["window"] == 3
    assert adm["store"]["backend"] == "memory" and adm["store"]["up"] is True
    async with s.http.get(s.url("/metrics")) as r:
        text = await r.text()
    for name in ("marsproxy_admission_window{", "marsproxy_admission_limit{",
                 "marsproxy_admission_admitted{", "marsproxy_admission_queue_length ",
                 # The caps as the state shows them (stable here: low KV use, fixed CPUs).
                 f'marsproxy_admission_kv_cap{{worker="w0"}} '
                 f'{float(adm["workers"]["w0"]["kv_cap"])}',
                 f'marsproxy_admission_cpu_cap{{worker="w1"}} '
                 f'{float(adm["workers"]["w1"]["cpu_cap"])}',
                 "marsproxy_admission_wait_seconds_count", "marsproxy_store_up 1.0"):
        assert name in text, name


async def _eq(value: Any, expected: int) -> bool:
    return bool(await value == expected)


async def _done(tasks: dict[str, asyncio.Task[Any]], n: int) -> bool:
    return sum(1 for t in tasks.values() if t.done()) >= n

