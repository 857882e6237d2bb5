"""A worker dies (SIGKILL) or hangs (SIGSTOP: it accepts connections and never answers).

Documented outcome (docs/reliability.md): streams on the dead or silent worker end with an SSE
``error`` event (``upstream_error`` / ``upstream_timeout``), buffered calls with 502 / 504; the
worker is ejected by health checking; the sessions' next calls go to a healthy worker; their
admission slots stay counted on the worker they were admitted to until they end, then are
released; the worker is readmitted when it answers again.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from tests.faults.conftest import (
    Lab,
    Proxy,
    bounded,
    call,
    chat_body,
    emulator_gauge,
    headers,
    until,
)

pytestmark = pytest.mark.timeout(60)

WINDOW = 8


def _pinned(window: int) -> dict[str, object]:
    return {"admission": {"window_init": window, "window_min": window, "window_max": window}}


async def _stream_until_first_event(
    p: Proxy, session: str, started: asyncio.Event, tokens: int
) -> tuple[int, str]:
    async with p.http.post(
        f"{p.url}/v1/chat/completions", json=chat_body(session, tokens=tokens, stream=True),
        headers=headers(session),
    ) as r:
        first = await r.content.readuntil(b"\n\n")
        started.set()
        rest = await r.content.read()
        return r.status, (first + rest).decode()


async def _sessions_by_worker(p: Proxy, sessions: list[str]) -> dict[str, str]:
    rows = (await p.state(sessions=True))["sessions"]["details"]
    placed = {str(r["id"]): str(r["worker"]) for r in rows}
    return {s: placed[s] for s in sessions}


async def test_worker_killed_mid_stream(lab: Lab) -> None:
    # KV room for every long stream: a preempted one would go silent (and be cut) on its own.
    big = ("--num-blocks", "4096")
    workers = {"w0": lab.emulator("w0", extra=big), "w1": lab.emulator("w1", extra=big)}
    p = lab.proxy(lab.config(workers, _pinned(WINDOW)))
    sessions = [f"kill-{i}" for i in range(6)]
    started = {s: asyncio.Event() for s in sessions}
    streams = {
        s: asyncio.create_task(_stream_until_first_event(p, s, started[s], tokens=4000))
        for s in sessions
    }
    await bounded(asyncio.gather(*(e.wait() for e in started.values())), 15, "first events")
    placed = await _sessions_by_worker(p, sessions)
    victim = placed[sessions[0]]
    on_victim = [s for s in sessions if placed[s] == victim]
    survivor = next(n for n in workers if n != victim)
    t0 = time.monotonic()
    workers[victim].kill()

    results = await bounded(asyncio.gather(*streams.values()), 20, "streams after the kill")
    cut_after = time.monotonic() - t0
    for s, (status, text) in zip(streams, results, strict=True):
        assert status == 200, (s, text[-300:])  # headers were sent before the fault
        if s in on_victim:  # a clean error event, then the end of the stream; no [DONE]
            assert '"code": "upstream_error"' in text, text[-300:]
            assert not text.endswith("[DONE]\n\n"), text[-300:]
        else:
            assert text.endswith("data: [DONE]\n\n"), (s, text[-300:])
    assert cut_after < 15

    # Health checking ejects the dead worker.
    await until(p.state, lambda st: not _healthy(st, victim), "dead worker ejected", 5)
    # The sessions' next calls go to the healthy worker; a new session too.
    for s in on_victim:
        r = await bounded(call(p.http, p.url, s), 10, f"next call of {s}")
        assert r.status == 200, r.body
        assert await p.worker_of(s) == survivor
    r = await bounded(call(p.http, p.url, "kill-new"), 10, "a new session")
    assert r.status == 200 and await p.worker_of("kill-new") == survivor

    # Nothing leaked: every session ends (final), and every slot is released.
    for s in [*sessions, "kill-new"]:
        r = await bounded(call(p.http, p.url, s, final=True), 10, f"final call of {s}")
        assert r.status == 200, r.body
    await until(p.admitted, lambda a: sum(a.values()) == 0, "all slots released", 5)
    st = await p.state()
    assert st["admission"]["queue"]["length"] == 0 and st["admission"]["queue"]["pending"] == 0
    running = await emulator_gauge(p.http, workers[survivor].url, "vllm:num_requests_running")
    assert running == 0


async def test_buffered_call_on_a_killed_worker_gets_502(lab: Lab) -> None:
    workers = {"w0": lab.emulator("w0", time_scale=3.0)}
    p = lab.proxy(lab.config(workers, _pinned(WINDOW)))
    pending = asyncio.create_task(call(p.http, p.url, "buf", tokens=1000))
    await until(lambda: emulator_gauge(p.http, workers["w0"].url, "vllm:num_requests_running"),
                lambda n: n >= 1, "the request is running on the worker", 10)
    workers["w0"].kill()
    r = await bounded(pending, 10, "buffered call on a killed worker")
    assert r.status == 502 and r.json()["error"]["code"] == "upstream_error", r.body
    await until(p.state, lambda st: not _healthy(st, "w0"), "dead worker ejected", 5)
    r = await bounded(call(p.http, p.url, "buf"), 5, "a call with no healthy worker")
    assert r.status == 503 and r.json()["error"]["code"] == "no_healthy_worker"
    assert int(r.headers["Retry-After"]) >= 1


async def test_hung_worker_times_out_is_ejected_and_comes_back(lab: Lab) -> None:
    workers = {"w0": lab.emulator("w0"), "w1": lab.emulator("w1")}
    p = lab.proxy(lab.config(workers, _pinned(WINDOW)))
    started = asyncio.Event()
    stream = asyncio.create_task(_stream_until_first_event(p, "hang-a", started, tokens=3000))
    await bounded(started.wait(), 10, "first event")
    victim = await p.worker_of("hang-a")
    survivor = next(n for n in workers if n != victim)
    t0 = time.monotonic()
    workers[victim].pause()
    try:
        status, text = await bounded(stream, 10, "stream on a hung worker")
        waited = time.monotonic() - t0
        # upstream.idle_timeout_s = 1.0: the stream is cut after that silence, not before.
        assert status == 200 and '"code": "upstream_timeout"' in text, text[-300:]
        assert 0.9 <= waited < 5, waited
        await until(p.state, lambda st: not _healthy(st, victim), "hung worker ejected", 5)
        r = await bounded(call(p.http, p.url, "hang-a"), 10, "next call of the session")
        assert r.status == 200 and await p.worker_of("hang-a") == survivor
    finally:
        workers[victim].resume()
    await until(p.state, lambda st: _healthy(st, victim), "recovered worker readmitted", 5)
    # The request the proxy gave up on was aborted in the worker once it ran again.
    await until(lambda: emulator_gauge(p.http, workers[victim].url, "vllm:num_requests_running"),
                lambda n: n == 0, "aborted request gone from the recovered worker", 5)
    # New sessions reach the recovered worker again.
    for i in range(6):
        assert (await call(p.http, p.url, f"hang-new-{i}", final=True)).status == 200
    counts = (await p.state())["workers"]
    assert all(w["healthy"] for w in counts)
    await until(p.admitted, lambda a: sum(a.values()) <= 1, "slots released", 5)


async def test_first_byte_timeout_on_a_worker_that_never_answers(lab: Lab) -> None:
    """A socket that accepts and never answers: 504 after upstream.first_byte_timeout_s."""
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(64)
        port = hole.getsockname()[1]

        class _Hole:
            url = f"http://127.0.0.1:{port}"

        # Admission off and a slow health loop: the request must reach the silent worker.
        cfg = lab.config({"hole": _Hole()},  # type: ignore[dict-item]
                         {"admission": {"enabled": False},
                          "health": {"interval_s": 30.0, "unhealthy_after": 3},
                          "upstream": {"first_byte_timeout_s": 0.8}})
        p = lab.proxy(cfg)
        t0 = time.monotonic()
        r = await bounded(call(p.http, p.url, "hole"), 10, "call to a silent worker")
        waited = time.monotonic() - t0
        assert r.status == 504 and r.json()["error"]["code"] == "upstream_timeout", r.body
        assert 0.75 <= waited < 3, waited


def _healthy(state: dict[str, object], worker: str) -> bool:
    rows = state["workers"]
    assert isinstance(rows, list)
    return bool(next(w for w in rows if w["name"] == worker)["healthy"])
