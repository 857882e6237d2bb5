"""``/mars/v1/state`` and ``/metrics`` against two emulated vLLM workers under load.

The probes scrape the emulators' real ``/metrics`` pages; nothing is faked. Polls have bounded
deadlines; no assertion is on wall-clock time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from marsproxy.config import load_config
from marsproxy.emulator.server import EmulatorOptions, create_app
from marsproxy.gateway.http.app import GATEWAY_KEY, Running, start
from marsproxy.gateway.http.app import create_app as create_gateway_app
from marsproxy.probes.nvml import NvmlProbe
from marsproxy.probes.poller import Poller


@dataclass
class Stack:
    proxy: Running
    workers: list[tuple[web.AppRunner, str]]
    http: aiohttp.ClientSession

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.proxy.port}{path}"

    async def state(self, query: str = "") -> dict[str, Any]:
        async with self.http.get(self.url("/mars/v1/state" + query)) as r:
            assert r.status == 200
            return await r.json()  # type: ignore[no-any-return]


FAST = {"period_s": 0.05, "idle_period_s": 0.05, "timeout_s": 0.2, "stale_after_s": 0.3}


@pytest.fixture
async def stack(run_app: Any) -> AsyncIterator[Stack]:
    async for s in _stack(run_app, FAST):
        yield s


async def _stack(run_app: Any, vllm_probe: dict[str, float]) -> AsyncIterator[Stack]:
    apps = [create_app(EmulatorOptions(profile="tiny", time_scale=1.0)) for _ in range(2)]
    workers = [await run_app(a) for a in apps]
    cfg = load_config(
        None,
        environ={},
        overrides={
            "workers": [{"url": u, "name": f"w{i}"} for i, (_, u) in enumerate(workers)],
            "server": {"port": 0},
            "health": {"interval_s": 0.1, "timeout_s": 0.5},
            "probes": {
                "vllm": vllm_probe,
                "nvml": {"enabled": False},
                "cpu": {"period_s": 0.1},
            },
        },
    )
    proxy = await start(cfg)
    async with aiohttp.ClientSession() as http:
        yield Stack(proxy, workers, http)
    await proxy.stop()
    for runner, _ in workers:
        await runner.cleanup()


async def _long_stream(s: Stack, session: str) -> None:
    body = {
        "model": "tiny-emulated",
        "messages": [{"role": "user", "content": "write a long story " * 40}],
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    async with s.http.post(
        s.url("/v1/chat/completions"), json=body, headers={"x-session-id": session}
    ) as r:
        assert r.status == 200
        async for _ in r.content.iter_any():
            pass


async def _poll(s: Stack, cond: Any, within: float = 10.0) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        doc = await s.state("?sessions=1")
        if cond(doc):
            return doc
        if loop.time() > end:
            raise AssertionError(f"state never matched; last: {doc}")
        await asyncio.sleep(0.05)


async def test_idle_workers_are_scraped_slowly_until_a_call_runs(run_app: Any) -> None:
    # Longer than every poll's bound: only the proxy's own call can bring a scrape in time.
    probe = {"period_s": 0.05, "idle_period_s": 30.0, "timeout_s": 0.5, "stale_after_s": 60.0}
    async for s in _stack(run_app, probe):
        def periods(doc: dict[str, Any]) -> list[float]:
            return [w["scrape_period_s"] for w in doc["workers"]]

        await _poll(s, lambda d: periods(d) == [30.0, 30.0])  # both idle after a first scrape
        stream = asyncio.create_task(_long_stream(s, "one"))
        try:
            # The worker serving it is scraped every period_s (its own page, once read, shows
            # the call running); the other stays idle.
            doc = await _poll(s, lambda d: sorted(periods(d)) == [0.05, 30.0] and any(
                (w["running"] or 0) > 0 for w in d["workers"]))
            serving = next(w for w in doc["workers"] if w["scrape_period_s"] == 0.05)
            assert serving["requests_in_flight"] == 1 and not serving["stale"]
        finally:
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)
        # Done: once a page shows nothing running there, idle again.
        await _poll(s, lambda d: periods(d) == [30.0, 30.0])


async def test_state_shows_load_then_staleness(stack: Stack) -> None:
    streams = [asyncio.create_task(_long_stream(stack, f"load-{i}")) for i in range(6)]
    try:
        def busy(doc: dict[str, Any]) -> bool:
            return any(
                (w["kv_usage"] or 0) > 0 and (w["running"] or 0) > 0 and not w["stale"]
                for w in doc["workers"]
            )

        doc = await _poll(stack, busy)
        assert doc["sessions"]["by_state"]["llm"] == 6 and doc["sessions"]["total"] == 6
        assert sum(w["requests_in_flight"] for w in doc["workers"]) == 6
        assert sum(w["sessions"] for w in doc["workers"]) == 6
        w = next(w for w in doc["workers"] if (w["running"] or 0) > 0)
        assert w["block_size"] == 16 and w["num_gpu_blocks"] == 512 and w["healthy"]
        assert w["max_model_len"] == 8192  # tiny's, from /v1/models: admission's forecast cap
        assert w["gpu"] == {"available": False, "memory_used_frac": None, "utilization_pct": None}
        assert {d["state"] for d in doc["sessions"]["details"]} == {"llm"}
        assert sorted(d["id"] for d in doc["sessions"]["details"]) == [
            f"load-{i}" for i in range(6)
        ]
        assert doc["cpu"]["tool_cpus"] > 0 and doc["cpu"]["source"]
        assert set(doc) == {
            "time", "version", "workers", "cpu", "tools", "sessions", "events", "scheduler",
            "admission",
        }
        # Six sessions fit the default window (30 per worker): all admitted, none waiting.
        adm = doc["admission"]
        assert sum(w["admitted"] for w in adm["workers"].values()) == 6
        assert adm["queue"]["length"] == 0 and adm["store"]["backend"] == "memory"
    finally:
        for t in streams:
            t.cancel()
        await asyncio.gather(*streams, return_exceptions=True)

    # Stop worker 1's server: its samples age past stale_after_s and it reads as stale, while
    # the live one does not (polled together: on a loaded machine one of w0's scrapes may time
    # out against the 0.2-s probe timeout and age it for a moment).
    await stack.workers[1][0].cleanup()
    doc = await _poll(stack, lambda d: d["workers"][1]["stale"] and not d["workers"][0]["stale"])
    dead = doc["workers"][1]
    assert dead["name"] == "w1" and dead["age_s"] is not None and dead["age_s"] > 0.3
    await _poll(stack, lambda d: d["workers"][1]["scrape_errors"] > 0)

    async def stale_gauge() -> dict[str, float]:
        async with stack.http.get(stack.url("/metrics")) as r:
            text = await r.text()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        return {s.labels["worker"]: s.value for s in fams["marsproxy_worker_stale"].samples}

    for _ in range(100):
        if (stale := await stale_gauge()) == {"w0": 0.0, "w1": 1.0}:
            break
        await asyncio.sleep(0.05)
    assert stale == {"w0": 0.0, "w1": 1.0}


async def test_state_shows_whether_a_keys_sessions_come_back(stack: Stack) -> None:
    # A session dormant after its first call that sends a second one came back: the record
    # that decides whether such sessions hold KV room (and grow) shows it per tenant.
    body = {"model": "tiny-emulated", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(2):
        async with stack.http.post(stack.url("/v1/chat/completions"), json=body,
                                   headers={"x-session-id": "agent-1"}) as r:
            assert r.status == 200
    doc = await stack.state()
    assert list(doc["admission"]["returns"].values()) == [[1, 1, 0]]


async def test_state_paging_and_bad_queries(stack: Stack) -> None:
    for i in range(5):
        async with stack.http.post(
            stack.url("/v1/chat/completions"),
            json={"model": "tiny-emulated", "max_tokens": 2,
                  "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-session-id": f"p{i}"},
        ) as r:
            assert r.status == 200
    page = await stack.state("?sessions=1&limit=2&offset=1")
    assert page["sessions"]["total"] == 5 and len(page["sessions"]["details"]) == 2
    assert "details" not in (await stack.state())["sessions"]
    for q in ("?limit=0", "?limit=x", "?offset=-1"):
        async with stack.http.get(stack.url("/mars/v1/state" + q)) as r:
            assert r.status == 400


EXPECTED_TYPES = {
    "marsproxy_worker_kv_usage_ratio": "gauge",
    "marsproxy_worker_requests_running": "gauge",
    "marsproxy_worker_requests_waiting": "gauge",
    "marsproxy_worker_stale": "gauge",
    "marsproxy_worker_sample_age_seconds": "gauge",
    "marsproxy_worker_scrape_errors": "counter",
    "marsproxy_cpu_pressure_some_avg10": "gauge",
    "marsproxy_tools_in_flight": "gauge",
    "marsproxy_tool_backlog_ratio": "gauge",
    "marsproxy_tool_queue_wait_ema_seconds": "gauge",
    "marsproxy_tool_slowdown_ratio": "gauge",
    "marsproxy_sessions": "gauge",
    "marsproxy_ttft_seconds": "histogram",
    "marsproxy_request_duration_seconds": "histogram",
    "marsproxy_tool_duration_seconds": "histogram",
    "marsproxy_events_published": "counter",
    "marsproxy_events_dropped": "counter",
}


async def test_metrics_families_and_no_session_ids(stack: Stack) -> None:
    sid = "metrics-session-7f3a"
    chat = {"model": "tiny-emulated", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}
    for extra in ({"stream": True}, {}):
        async with stack.http.post(
            stack.url("/v1/chat/completions"), json={**chat, **extra},
            headers={"x-session-id": sid},
        ) as r:
            assert r.status == 200
            await r.read()
    await _poll(stack, lambda d: all(w["kv_usage"] is not None for w in d["workers"]))
    async with stack.http.post(
        stack.url(f"/mars/v1/sessions/{sid}/events"), json={"type": "tool_start", "tool": "ls"}
    ) as r:
        assert r.status == 202
    async with stack.http.post(
        stack.url(f"/mars/v1/sessions/{sid}/events"), json={"type": "tool_end", "tool": "ls"}
    ) as r:
        assert r.status == 202
    async with stack.http.get(stack.url("/metrics")) as r:
        text = await r.text()
        # The exposition format's version, as prometheus_client (and vLLM) announce it.
        assert r.headers["Content-Type"] == CONTENT_TYPE_LATEST
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in EXPECTED_TYPES.items():
        assert name in fams, name
        assert fams[name].type == kind, (name, fams[name].type)
    sessions = {s.labels["state"]: s.value for s in fams["marsproxy_sessions"].samples}
    assert sessions == {"llm": 0.0, "tool": 0.0, "idle": 1.0}
    ttft = [s for s in fams["marsproxy_ttft_seconds"].samples if s.name.endswith("_count")]
    assert ttft and ttft[0].labels == {"route": "chat"} and ttft[0].value == 2
    tools = {s.labels["inferred"]: s.value for s in fams["marsproxy_tool_duration_seconds"].samples
             if s.name.endswith("_count")}
    assert tools.get("false") == 1
    published = fams["marsproxy_events_published"].samples[0].value
    assert published > 0
    kv = {s.labels["worker"] for s in fams["marsproxy_worker_kv_usage_ratio"].samples}
    assert kv == {"w0", "w1"}
    # Bounded labels: no session id (or any part of a session key) in any label.
    for fam in fams.values():
        for s in fam.samples:
            assert "session" not in s.labels
            for v in s.labels.values():
                assert sid not in v and "/id/" not in v


class _FakeNvmlError(Exception):
    pass


class _FakeNvml:
    """NVML at the library boundary: two GPUs, 40 GiB of 80 used, 75 % and 25 % busy."""

    NVMLError: type[Exception] = _FakeNvmlError

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return SimpleNamespace(used=40 << 30, total=80 << 30)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=75 if handle == 0 else 25, memory=10)


async def test_gpu_pressure_from_nvml_reaches_state_and_metrics(fake: Any) -> None:
    cfg = load_config(None, environ={}, overrides={
        "workers": [{"url": fake.url, "name": "g0"}],
        "server": {"port": 0},
        "probes": {"nvml": {"gpus_by_worker": {"g0": [0, 1]}, "period_s": 0.05}},
    })
    app = create_gateway_app(cfg)
    tel = app[GATEWAY_KEY].telemetry
    tel.nvml = NvmlProbe.from_config(cfg.probes.nvml, nvml=_FakeNvml())
    tel.gpu = Poller("nvml", tel.nvml.read_all, 0.05, in_thread=True)
    proxy = await start(cfg, app)
    try:
        async with aiohttp.ClientSession() as http:
            s = Stack(proxy, [], http)
            doc = await _poll(s, lambda d: d["workers"][0]["gpu"]["available"])
            assert doc["workers"][0]["gpu"] == {
                "available": True, "memory_used_frac": 0.5, "utilization_pct": 50.0
            }
            async with http.get(s.url("/metrics")) as r:
                text = await r.text()
        assert 'marsproxy_worker_gpu_utilization_percent{worker="g0"} 50.0' in text
    finally:
        await proxy.stop()


class _WedgingNvml(_FakeNvml):
    """NVML whose calls block while ``ok`` is clear, as a hung driver's do."""

    def __init__(self) -> None:
        self.ok = threading.Event()

    def nvmlInit(self) -> None:
        self.ok.wait()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        self.ok.wait()
        return super().nvmlDeviceGetMemoryInfo(handle)


async def test_a_wedged_nvml_driver_stalls_neither_start_nor_requests_nor_stop(
    fake: Any,
) -> None:
    cfg = load_config(None, environ={}, overrides={
        "workers": [{"url": fake.url, "name": "g0"}],
        "server": {"port": 0},
        "probes": {"nvml": {"gpus_by_worker": {"g0": [0]}, "period_s": 0.05}},
    })
    app = create_gateway_app(cfg)
    tel = app[GATEWAY_KEY].telemetry
    nvml = _WedgingNvml()
    tel.nvml = NvmlProbe.from_config(cfg.probes.nvml, nvml=nvml)
    tel.gpu = Poller("nvml", tel.nvml.read_all, 0.05, in_thread=True)
    proxy = await asyncio.wait_for(start(cfg, app), 10)  # NVML's init hangs meanwhile
    try:
        async with aiohttp.ClientSession() as http:
            s = Stack(proxy, [], http)
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(s.url("/v1/chat/completions"), json=body) as r:
                assert r.status == 200
            assert not (await s.state())["workers"][0]["gpu"]["available"]
            nvml.ok.set()  # the driver answers: readings begin
            await _poll(s, lambda d: d["workers"][0]["gpu"]["available"])
            nvml.ok.clear()  # and hangs again: the reading is not shown as current
            await _poll(s, lambda d: not d["workers"][0]["gpu"]["available"])
    finally:
        await asyncio.wait_for(proxy.stop(), 10)
        nvml.ok.set()
