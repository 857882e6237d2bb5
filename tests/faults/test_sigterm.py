"""SIGTERM under load: streams finish or are cut at the drain deadline; queued sessions get 503.

Documented outcome (docs/architecture.md "Health and shutdown", docs/admission.md refusals):
``marsproxy serve`` stops accepting, answers requests held for admission 503
``shutting_down`` with ``Retry-After`` at once, lets in-flight streams run for up to
``server.drain_timeout_s``, then cuts the rest (which aborts their upstream requests) and exits 0.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
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

DRAIN_S = 2.0


async def _stream(p: Proxy, session: str, tokens: int, started: asyncio.Event) -> str:
    """The stream's text; ``...<cut>`` appended when the connection ended early."""
    async with p.http.post(
        f"{p.url}/v1/chat/completions", json=chat_body(session, tokens=tokens, stream=True),
        headers=headers(session, final=True),
    ) as r:
        assert r.status == 200
        chunks = [await r.content.readuntil(b"\n\n")]
        started.set()
        try:
            chunks.append(await r.content.read())
        except aiohttp.ClientPayloadError:
            chunks.append(b"...<cut>")
        return b"".join(chunks).decode()


async def test_sigterm_drains_streams_and_refuses_the_queue(lab: Lab) -> None:
    w = lab.emulator("w0", time_scale=3.0)
    p = lab.proxy(lab.config({"w0": w}, {
        "server": {"drain_timeout_s": DRAIN_S},
        "admission": {"window_init": 2, "window_min": 2, "window_max": 2},
    }))
    started = {s: asyncio.Event() for s in ("short", "long")}
    short = asyncio.create_task(_stream(p, "short", 250, started["short"]))  # ~1 s
    long = asyncio.create_task(_stream(p, "long", 6000, started["long"]))  # ~25 s
    await bounded(asyncio.gather(*(e.wait() for e in started.values())), 10, "streams start")
    queued = [asyncio.create_task(call(p.http, p.url, f"q{i}", final=True)) for i in range(3)]
    await until(p.state, lambda st: st["admission"]["queue"]["length"] == 3,
                "three sessions queued", 5)

    t0 = time.monotonic()
    p.svc.terminate()
    refusals = await bounded(asyncio.gather(*queued), 2, "queued sessions after SIGTERM")
    for r in refusals:
        assert r.status == 503 and r.json()["error"]["code"] == "shutting_down", r.body
        assert int(r.headers["Retry-After"]) >= 1
    assert time.monotonic() - t0 < 1.0  # at once, not at the drain deadline

    text = await bounded(short, DRAIN_S + 2, "the stream that finishes within the drain")
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    text = await bounded(long, DRAIN_S + 5, "the stream cut at the drain deadline")
    cut_at = time.monotonic() - t0
    assert not text.endswith("data: [DONE]\n\n"), text[-200:]
    assert DRAIN_S * 0.9 <= cut_at <= DRAIN_S + 3, cut_at

    proc = p.svc.proc
    assert proc is not None
    assert await bounded(asyncio.to_thread(proc.wait), 10, "proxy exit") == 0
    # The cut stream's upstream request was aborted, not left running in the worker.
    await until(lambda: emulator_gauge(p.http, w.url, "vllm:num_requests_running"),
                lambda n: n == 0, "worker requests after the proxy stopped", 5)
