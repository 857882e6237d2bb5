"""The information stream through the gateway, over real sockets: the event stream, the tool
tracker (inferred and explicit), the admin session API, and the JSONL sink.

Workers are the scriptable fake of conftest.py (it also serves a small vLLM /metrics page).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.config import MarsConfig, load_config
from marsproxy.gateway.http.app import Running, start

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
AUTH = {"Authorization": "Bearer sk-tenant-a"}


def config(workers: list[str], **sections: Any) -> MarsConfig:
    over: dict[str, Any] = {
        "workers": workers,
        "server": {"port": 0},
        "probes": {"vllm": {"period_s": 0.05, "stale_after_s": 0.3}, "nvml": {"enabled": False}},
    }
    for k, v in sections.items():
        over[k] = {**over.get(k, {}), **v}
    return load_config(None, environ={}, overrides=over)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def gw(fake: Any) -> AsyncIterator[Running]:
    g = await start(config([fake.url]))
    yield g
    await g.stop()


def url(g: Running, path: str) -> str:
    return f"http://127.0.0.1:{g.port}{path}"


class Events:
    """Reads ``/mars/v1/events?format=ndjson`` in the background into ``got``."""

    def __init__(self, http: aiohttp.ClientSession, g: Running, query: str = "") -> None:
        self._http, self._url = http, url(g, "/mars/v1/events?format=ndjson" + query)
        self.got: list[dict[str, Any]] = []
        self._resp: aiohttp.ClientResponse | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Events:
        self._resp = await self._http.get(self._url)
        assert self._resp.status == 200
        assert self._resp.headers["Content-Type"].startswith("application/x-ndjson")
        self._task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self._resp is not None
        async for line in self._resp.content:
            if line.strip():  # blank lines are keep-alives
                self.got.append(json.loads(line))

    async def __aexit__(self, *_: object) -> None:
        assert self._resp is not None and self._task is not None
        self._resp.close()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            await self._task

    def of(self, session_id: str) -> list[dict[str, Any]]:
        return [e for e in self.got if (e.get("session") or "").endswith("/id/" + session_id)]

    def types(self, session_id: str) -> list[str]:
        return [e["type"] for e in self.of(session_id)]


async def chat(
    http: aiohttp.ClientSession, g: Running, session: str, *, final: bool = False,
    stream: bool = False, auth: dict[str, str] = AUTH,
) -> None:
    headers = {**auth, "x-session-id": session}
    if final:
        headers["x-session-final"] = "true"
    async with http.post(
        url(g, "/v1/chat/completions"), json={**CHAT, "stream": stream}, headers=headers
    ) as r:
        assert r.status == 200
        await r.read()


async def post_event(
    http: aiohttp.ClientSession, g: Running, session: str, body: Any,
    auth: dict[str, str] = AUTH,
) -> tuple[int, dict[str, Any]]:
    async with http.post(
        url(g, f"/mars/v1/sessions/{session}/events"), json=body, headers=auth
    ) as r:
        return r.status, await r.json()


async def state(http: aiohttp.ClientSession, g: Running, query: str = "") -> dict[str, Any]:
    async with http.get(url(g, "/mars/v1/state" + query)) as r:
        assert r.status == 200
        return await r.json()  # type: ignore[no-any-return]


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


async def test_stream_filters_by_type_and_session(gw: Running, http: aiohttp.ClientSession,
                                                  until: Any) -> None:
    async with Events(http, gw, "&type=llm_end") as only_ends, \
            Events(http, gw, "&session=f1") as only_f1:
        await chat(http, gw, "f1")
        await chat(http, gw, "f2")
        await until(lambda: len(only_ends.got) == 2 and len(only_f1.got) >= 4)
        await asyncio.sleep(0.1)
    assert {e["type"] for e in only_ends.got} == {"llm_end"}
    assert {e["session"].rsplit("/", 1)[1] for e in only_ends.got} == {"f1", "f2"}
    assert only_f1.got and all(e["session"].endswith("/id/f1") for e in only_f1.got)
    async with http.get(url(gw, "/mars/v1/events?type=nope")) as r:
        assert r.status == 400 and "type:" in (await r.json())["error"]["message"]


async def test_sse_client_that_leaves_closes_its_subscription(
    gw: Running, http: aiohttp.ClientSession, until: Any
) -> None:
    bus = gw.gateway.telemetry.bus
    base = bus.subscribers
    resp = await http.get(url(gw, "/mars/v1/events"))
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    assert bus.subscribers == base + 1
    await chat(http, gw, "sse")
    text = b""
    while b"event: llm_end\n" not in text:
        text += await resp.content.readany()
    assert b"data: {" in text
    resp.close()  # the client goes away
    await until(lambda: bus.subscribers == base)


async def test_rejections_are_events(dead_url: str, http: aiohttp.ClientSession,
                                     until: Any) -> None:
    g = await start(config([dead_url], health={"interval_s": 0.05, "unhealthy_after": 1}))
    try:
        await until(lambda: not g.gateway.healthy())
        async with Events(http, g, "&type=rejected") as ev:
            async with http.post(url(g, "/v1/chat/completions"), json=CHAT) as r:
                assert r.status == 503
            async with http.post(url(g, "/v1/chat/completions"), data=b"{nope") as r:
                assert r.status == 400
            await until(lambda: len(ev.got) == 2)
        assert [(e["reason"], e["status"]) for e in ev.got] == [
            ("no_healthy_worker", 503), ("invalid_json", 400)
        ]
    finally:
        await g.stop()


async def test_jsonl_sink_writes_the_run(fake: Any, http: aiohttp.ClientSession,
                                         tmp_path: Path, until: Any) -> None:
    path = tmp_path / "events.jsonl"
    tel = {"jsonl_path": str(path), "pressure_sample_every": 1}
    g = await start(config([fake.url], telemetry=tel))
    try:
        samples = g.gateway.telemetry.bus.subscribe(lambda e: e.type == "pressure_sample")
        await chat(http, g, "j1")
        await chat(http, g, "j1", final=True)
        await until(lambda: bool(samples.poll()))
    finally:
        await g.stop()  # flushes the sink
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    mine = [r["type"] for r in rows if (r.get("session") or "").endswith("/id/j1")]
    assert mine == [
        "session_queued", "session_admitted",
        "dispatch", "first_token", "llm_end", "retention_decision", "tool_start",
        "tool_end", "dispatch", "first_token", "llm_end", "session_end",
    ]
    assert any(r["type"] == "pressure_sample" for r in rows)


async def test_redis_stream_sink_from_config(fake: Any, http: aiohttp.ClientSession) -> None:
    import uuid

    import redis.asyncio as aioredis

    r = aioredis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=1)
    try:
        await r.ping()
    except Exception as exc:  # .ci/run starts Redis; a bare `pytest` elsewhere may have none
        await r.aclose()
        pytest.skip(f"no Redis on 127.0.0.1:6379 ({exc!r})")
    key = f"marsproxy-test:{uuid.uuid4().hex}:events"
    rs = {"url": "redis://127.0.0.1:6379/0", "key": key, "maxlen": 1000}
    g = await start(config([fake.url], telemetry={"redis_stream": rs}))
    try:
        await chat(http, g, "r1", final=True)
    finally:
        await g.stop()
    try:
        entries: Any = await r.xrange(key)
        rows = [json.loads(fields[b"data"]) for _, fields in entries]
        mine = [e["type"] for e in rows if (e.get("session") or "").endswith("/id/r1")]
        assert mine == ["session_queued", "session_admitted", "dispatch", "first_token",
                        "llm_end", "session_end"]
    finally:
        await r.delete(key)
        await r.aclose()


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


async def test_sse_keepalive_and_shutdown_ends_open_streams(
    fake: Any, http: aiohttp.ClientSession
) -> None:
    # A long drain timeout: stopping must not wait for the live stream to end by itself.
    g = await start(config([fake.url], telemetry={"sse_keepalive_s": 0.05},
                          server={"drain_timeout_s": 600}))
    stopped = False
    resp = await http.get(url(g, "/mars/v1/events"))
    try:
        text = b""
        while text.count(b": keep-alive\n\n") < 3:  # the first comes at once, then when idle
            text += await resp.content.readany()
        assert b"event:" not in text
        await asyncio.wait_for(g.stop(), 10)
        stopped = True
        while await resp.content.readany():  # the proxy ended the stream: EOF, not a hang
            pass
    finally:
        resp.close()  # (if stop hung: the client leaving lets the rest of the shutdown finish)
        if not stopped:
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
