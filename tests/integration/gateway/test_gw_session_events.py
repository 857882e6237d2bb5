"""Sessions on the information stream, through the gateway over real sockets: a session's
events from first request to end, the tool tracker (inferred and explicit), the admin session
API (posted events, DELETE) and the session-duration histogram.

Workers are the scriptable fake of conftest.py. The stream itself and its sinks:
test_gw_telemetry.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.gateway.http.app import Running, start

from .telemetry_client import AUTH, Events, chat, config, post_event, state, url


async def test_lifecycle_and_inferred_tool_phase(gw: Running, http: aiohttp.ClientSession,
                                                 until: Any) -> None:
    gap = 0.3
    async with Events(http, gw) as ev:
        await chat(http, gw, "s1", stream=True)
        await asyncio.sleep(gap)  # the "tool" the agent runs between two turns
        await chat(http, gw, "s1")
        await chat(http, gw, "s1", final=True)
        await until(lambda: "session_end" in ev.types("s1"))
    assert ev.types("s1") == [
        "session_queued", "session_admitted",  # admission (on by default) lets it in at once
        "dispatch", "first_token", "llm_end", "retention_decision", "tool_start",
        "tool_end", "dispatch", "first_token", "llm_end", "retention_decision", "tool_start",
        "tool_end", "dispatch", "first_token", "llm_end", "session_end",
    ]
    by_type = {e["type"]: e for e in ev.of("s1")}
    start_ev, end_ev = by_type["tool_start"], [e for e in ev.of("s1") if e["type"] == "tool_end"]
    assert start_ev["inferred"] is True and start_ev["tool"] == "unknown"
    assert end_ev[0]["inferred"] is True and end_ev[0]["duration_s"] >= gap
    llm_end = by_type["llm_end"]
    assert llm_end["status"] == 200 and llm_end["prompt_tokens"] == 7
    assert llm_end["completion_tokens"] == 3
    assert llm_end["worker"] == gw.gateway.cfg.workers[0].label
    assert [e["turn"] for e in ev.of("s1") if e["type"] == "dispatch"] == [1, 2, 3]
    assert by_type["first_token"]["ttft_s"] > 0
    end = by_type["session_end"]
    assert end["reason"] == "final" and end["turns"] == 3 and end["duration_s"] >= gap
    # The tracker forgot the session with it.
    assert (await state(http, gw))["tools"]["in_flight"] == 0


async def test_explicit_events_override_inference(gw: Running, http: aiohttp.ClientSession,
                                                  until: Any) -> None:
    async with Events(http, gw, "&type=tool_start,tool_end") as ev:
        await chat(http, gw, "s2")  # an inferred phase opens here ...
        status, body = await post_event(
            http, gw, "s2", {"type": "tool_start", "tool": "pytest", "queue_wait_s": 0.5}
        )
        assert status == 202 and body["published"] == ["tool_start"]
        doc = await state(http, gw, "?sessions=1")
        (row,) = [d for d in doc["sessions"]["details"] if d["id"] == "s2"]
        assert row["state"] == "tool" and row["tool"] == "pytest" and row["turns"] == 1
        assert doc["tools"]["in_flight"] == 1 and doc["tools"]["queue_wait_ema_s"] > 0
        await asyncio.sleep(0.1)
        status, body = await post_event(http, gw, "s2", {"type": "tool_end", "tool": "pytest"})
        assert status == 202 and body["published"] == ["tool_end"]
        await chat(http, gw, "s2")  # ... and no inferred phase once the agent reports its own
        await chat(http, gw, "s2")
        await until(lambda: len(ev.got) >= 3)
        await asyncio.sleep(0.1)  # anything inferred would have arrived by now
    # The inferred phase was replaced silently; only the explicit pair is on the stream.
    assert [(e["type"], e["tool"], e["inferred"]) for e in ev.of("s2")] == [
        ("tool_start", "unknown", True),
        ("tool_start", "pytest", False),
        ("tool_end", "pytest", False),
    ]
    assert ev.of("s2")[2]["duration_s"] >= 0.1
    assert (await state(http, gw))["tools"]["in_flight"] == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tool": "pytest"}, "type"),
        ({"type": "tool_begin", "tool": "pytest"}, "type"),
        ({"type": "tool_start"}, "tool"),
        ({"type": "tool_start", "tool": ""}, "tool"),
        ({"type": "tool_start", "tool": "x" * 65}, "tool"),
        ({"type": "tool_start", "tool": "pytest", "ts": "now"}, "ts"),
        ({"type": "tool_start", "tool": "pytest", "ts": 1.0}, "ts"),  # older than an hour
        ({"type": "tool_start", "tool": "pytest", "ts": 4e9}, "ts"),  # in the future
        ({"type": "tool_end", "tool": "pytest", "queue_wait_s": -1}, "queue_wait_s"),
        ({"type": "tool_end", "tool": "pytest", "queue_wait": 1}, "queue_wait"),
        ([1, 2], "body"),
    ],
)
async def test_bad_event_bodies_get_400_naming_the_field(
    gw: Running, http: aiohttp.ClientSession, body: Any, field: str
) -> None:
    await chat(http, gw, "s3")
    status, got = await post_event(http, gw, "s3", body)
    assert status == 400
    assert got["error"]["type"] == "invalid_request_error"
    assert got["error"]["message"].startswith(f"{field}:") or field == "body"


async def test_unknown_session_and_other_tenant_get_404(
    gw: Running, http: aiohttp.ClientSession
) -> None:
    ok = {"type": "tool_start", "tool": "make"}
    status, got = await post_event(http, gw, "nobody", ok)
    assert status == 404 and got["error"]["code"] == "session_not_found"
    await chat(http, gw, "mine")
    other = {"Authorization": "Bearer sk-tenant-b"}
    assert (await post_event(http, gw, "mine", ok, auth=other))[0] == 404
    async with http.delete(url(gw, "/mars/v1/sessions/mine"), headers=other) as r:
        assert r.status == 404
    assert (await post_event(http, gw, "mine", ok))[0] == 202  # its own tenant still can


async def test_delete_ends_the_session(gw: Running, http: aiohttp.ClientSession,
                                       until: Any) -> None:
    async with Events(http, gw, "&session=gone&type=session_end") as ev:
        await chat(http, gw, "gone")
        await chat(http, gw, "stays")
        assert (await state(http, gw))["sessions"]["total"] == 2
        async with http.delete(url(gw, "/mars/v1/sessions/gone"), headers=AUTH) as r:
            assert r.status == 200 and (await r.json())["ended"] is True
        await until(lambda: len(ev.got) == 1)
    assert ev.got[0]["reason"] == "deleted" and ev.got[0]["turns"] == 1
    doc = await state(http, gw, "?sessions=1")
    assert doc["sessions"]["total"] == 1
    assert [d["id"] for d in doc["sessions"]["details"]] == ["stays"]
    async with http.delete(url(gw, "/mars/v1/sessions/gone"), headers=AUTH) as r:
        assert r.status == 404


async def test_idle_sessions_end_without_traffic(fake: Any, http: aiohttp.ClientSession,
                                                 until: Any) -> None:
    g = await start(config([fake.url], sessions={"idle_ttl_s": 0.2}))
    try:
        async with Events(http, g, "&type=session_end") as ev:
            await chat(http, g, "sleepy")
            await until(lambda: len(ev.got) == 1)  # no further request comes to trigger it
        assert ev.got[0]["reason"] == "idle" and ev.got[0]["session"].endswith("/id/sleepy")
        assert g.gateway.telemetry.tracker.in_flight == 0  # its open tool phase went with it
        async with http.get(url(g, "/mars/v1/sessions/x")) as r:  # not passed to a worker
            assert r.status == 405 and r.headers["Allow"] == "DELETE" and not fake.seen[1:]
    finally:
        await g.stop()


def _samples(page: str, name: str) -> dict[str, float]:
    """reason label → value of ``name``'s samples on a /metrics page."""
    return {s.labels["reason"]: s.value
            for f in text_string_to_metric_families(page) for s in f.samples if s.name == name}


async def test_session_duration_is_observed_once_per_session(
    fake: Any, http: aiohttp.ClientSession, until: Any
) -> None:
    g = await start(config([fake.url], sessions={"idle_ttl_s": 1.0}))
    try:
        loop = asyncio.get_running_loop()
        async with Events(http, g, "&type=session_end") as ev:
            t0 = loop.time()
            await chat(http, g, "two", stream=True)
            await asyncio.sleep(0.3)  # the tool phase between the turns
            await chat(http, g, "two", final=True)
            span = loop.time() - t0
            await chat(http, g, "sleepy")  # goes idle: ends after idle_ttl_s unseen
            await until(lambda: len(ev.got) == 2)
        async with http.get(url(g, "/metrics")) as r:
            page = await r.text()
        count = _samples(page, "marsproxy_session_duration_seconds_count")
        total = _samples(page, "marsproxy_session_duration_seconds_sum")
        assert count == {"final": 1.0, "idle": 1.0, "evicted": 0.0, "deleted": 0.0}
        # First request to the end of the last response, as the client saw it.
        assert 0.3 <= total["final"] <= span
        # The idle one: its one request, not the idle time before it was forgotten.
        assert total["idle"] < 1.0
    finally:
        await g.stop()


async def test_a_failed_session_end_does_not_stop_expiry(
    fake: Any, http: aiohttp.ClientSession, until: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass of the periodic expiry that fails (a bug in one idle session's end) does not
    stop the next: that end is tried again, and the next idle session ends without traffic."""
    g = await start(config([fake.url], sessions={"idle_ttl_s": 0.2}))
    gw, calls = g.gateway, []
    real = gw.session_over

    def fails_once(key: str, end: Any) -> None:
        calls.append(key)
        if len(calls) == 1:
            raise RuntimeError("a bug in a session's end")
        real(key, end)

    monkeypatch.setattr(gw, "session_over", fails_once)
    try:
        await chat(http, g, "first")
        await until(lambda: len(calls) == 1)  # its idle end failed
        async with Events(http, g, "&type=session_end") as ev:
            await chat(http, g, "second")
            # No further request comes to trigger it.
            await until(lambda: any(e["session"].endswith("/id/second") for e in ev.got))
        assert {e["reason"] for e in ev.got} == {"idle"}
        assert len(gw.sessions) == 0 and calls[1] == calls[0]  # the failed end, again
    finally:
        await g.stop()
