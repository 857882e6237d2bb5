"""VllmScraper against real aiohttp servers on loopback.

Time is judged by an injected clock the test moves by hand, so no assertion depends on how fast
this machine is; real time is only waited on (with a generous bound) for scrapes to happen.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from marsproxy.probes.config import VllmProbeConfig
from marsproxy.probes.vllm_metrics import READ_NAMES, WorkerMetrics
from marsproxy.probes.vllm_rates import WorkerRates
from marsproxy.probes.vllm_scraper import MAX_PAGE_BYTES, VllmScraper

PAGE = Path(__file__).parents[2] / "unit" / "probes" / "fixtures" / "vllm-like-single.txt"
IDLE_PAGE = (
    PAGE.read_text()
    .replace('vllm:num_requests_running{engine="0",model_name="tiny"} 3.0',
             'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0')
    .replace('vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0',
             'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0')
)


@dataclass
class FakeClock:
    t: float = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Workers:
    """One server, one path prefix per worker; ``mode[name]`` says how it answers."""

    base: str
    mode: dict[str, str] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    encodings: set[str] = field(default_factory=set)
    filtered_hits: dict[str, int] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"


@pytest.fixture
async def workers() -> AsyncIterator[Workers]:
    page = PAGE.read_text()
    state = Workers(base="")

    async def metrics(request: web.Request) -> web.StreamResponse:
        # /metrics: the whole page; /metrics/ as vLLM's: the series named in name[] only.
        name = request.match_info["name"]
        state.hits[name] = state.hits.get(name, 0) + 1
        state.encodings.add(request.headers.get("Accept-Encoding", ""))
        mode = state.mode.get(name, "ok")
        keep: tuple[str, ...] = ()
        if request.path.endswith("/"):
            state.filtered_hits[name] = state.filtered_hits.get(name, 0) + 1
            state.names = request.query.getall("name[]")
            if mode == "no-filter":  # a server without the route
                return web.Response(status=404, text="Not Found")
            keep = tuple(state.names)
        if mode == "hang":
            await state.release.wait()
        if mode == "500":
            return web.Response(status=500, text="Internal Server Error")
        if mode == "garbage":
            return web.Response(text="<html><body>oops</body></html>")
        text = IDLE_PAGE if mode == "idle" else page  # idle: nothing running or queued
        if mode == "inf":  # a broken exporter
            text = text.replace("} 3.0\n", "} +Inf\n")
        if keep:
            text = "".join(line for line in text.splitlines(keepends=True)
                           if line.startswith("#") or line.startswith(keep))
        if mode == "huge":  # filter or not, a page with runaway label cardinality: ~40 MB
            text += "".join(f'other_series{{id="{i}"}} 1.0\n' for i in range(1_500_000))
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/{name}/metrics", metrics)
    app.router.add_get("/{name}/metrics/", metrics)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    state.base = str(server.make_url("")).rstrip("/")
    try:
        yield state
    finally:
        state.release.set()
        await server.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def wait_until(cond: Callable[[], bool], what: str, bound_s: float = 10.0) -> None:
    """Wait for something that must happen; the bound only turns a hang into a failure."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while not cond():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        await asyncio.sleep(0.01)


def make(
    workers: Workers, http: aiohttp.ClientSession, clock: FakeClock, **kw: object
) -> VllmScraper:
    # A generous timeout: a loaded CI machine must not turn a healthy worker into errors.
    opts: dict[str, object] = {"period_s": 0.02, "timeout_s": 2.0, "stale_after_s": 1.0}
    opts.update(kw)
    return VllmScraper(
        [("a", workers.url("a")), ("b", workers.url("b"))],
        http,
        clock=clock,
        **opts,  # type: ignore[arg-type]
    )


async def test_fresh_samples_then_stale_when_worker_fails(
    workers: Workers, http: aiohttp.ClientSession
) -> None:
    clock = FakeClock()
    scraper = make(workers, http, clock)
    assert scraper.snapshot("a").stale  # nothing scraped yet: fail closed
    await scraper.start()
    try:
        await wait_until(lambda: scraper.snapshot("a").metrics is not None, "first sample of a")
        await wait_until(lambda: scraper.snapshot("b").metrics is not None, "first sample of b")
        snap = scraper.snapshot("a")
        assert not snap.stale and snap.scrape_errors == 0
        assert snap.metrics is not None and snap.metrics.kv_usage == pytest.approx(0.8125)
        assert snap.kv_usage_fail_closed == pytest.approx(0.8125)

        workers.mode["a"] = "500"
        errors_before = scraper.snapshot("a").scrape_errors
        await wait_until(lambda: scraper.snapshot("a").scrape_errors > errors_before, "a error")
        clock.t += 0.5  # still within stale_after
        assert not scraper.snapshot("a").stale
        clock.t += 0.6  # now 1.1 s after a's last good sample
        hits_b = workers.hits["b"]
        await wait_until(lambda: workers.hits["b"] > hits_b + 2, "b keeps being scraped")
        await wait_until(
            lambda: (scraper.snapshot("b").age_s or 0) < 1.0, "b sampled at the new clock time"
        )
        a, b = scraper.snapshot("a"), scraper.snapshot("b")
        assert a.stale and a.kv_usage_fail_closed == 1.0
        assert a.last_error == "HTTP 500"
        assert a.age_s is not None and a.age_s > 1.0
        assert not b.stale and b.scrape_errors == 0

        workers.mode["a"] = "ok"
        await wait_until(lambda: not scraper.snapshot("a").stale, "a recovers")
        assert scraper.snapshot("a").scrape_errors >= 1  # the count is kept
    finally:
        await scraper.stop()
    assert not scraper.running


async def test_hung_worker_does_not_delay_the_others(
    workers: Workers, http: aiohttp.ClientSession
) -> None:
    # A timeout far longer than the test: a's single scrape stays in flight throughout.
    clock = FakeClock()
    scraper = make(workers, http, clock, timeout_s=60.0)
    workers.mode["a"] = "hang"
    await scraper.start()
    try:
        await wait_until(lambda: workers.hits.get("a", 0) == 1, "a's scrape is in flight")
        await wait_until(lambda: workers.hits.get("b", 0) >= 10, "b scraped many times")
        assert workers.hits["a"] == 1
        clock.t += 5.0
        await wait_until(lambda: not scraper.snapshot("b").stale, "b sampled after the jump")
        assert scraper.snapshot("a").stale
    finally:
        await scraper.stop()  # must cancel the hung scrape, not wait for it


async def test_timeouts_and_garbage_count_as_errors(
    workers: Workers, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    scraper = make(workers, http, clock, timeout_s=0.05)
    workers.mode["a"] = "hang"
    workers.mode["b"] = "garbage"
    with caplog.at_level(logging.WARNING, logger="marsproxy.probes.vllm_scraper"):
        await scraper.start()
        try:
            await wait_until(lambda: scraper.snapshot("a").scrape_errors >= 3, "a timeouts")
            await wait_until(lambda: scraper.snapshot("b").scrape_errors >= 3, "b garbage")
        finally:
            await scraper.stop()
    a, b = scraper.snapshot("a"), scraper.snapshot("b")
    assert a.last_error == "TimeoutError" and a.stale and a.metrics is None
    assert b.last_error is not None and b.last_error.startswith("MetricsParseError")
    # One warning per failing run, not one per error.
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2


async def test_an_infinite_gauge_neither_ends_the_loop_nor_reaches_the_sample(
    workers: Workers, http: aiohttp.ClientSession
) -> None:
    workers.mode["a"] = "inf"  # vllm:num_requests_running +Inf
    clock = FakeClock()
    scraper = make(workers, http, clock)
    await scraper.start()
    try:
        await wait_until(lambda: workers.hits.get("a", 0) >= 3, "a scraped again and again")
        snap = scraper.snapshot("a")
        assert snap.metrics is not None and snap.metrics.running is None  # unknown, not inf
        assert snap.metrics.kv_usage == pytest.approx(0.8125)
        workers.mode["a"] = "ok"
        await wait_until(lambda: (m := scraper.snapshot("a").metrics) is not None
                         and m.running == 3, "a read again once the page is sane")
    finally:
        await scraper.stop()


async def test_a_huge_page_is_a_scrape_error_not_parsed(
    workers: Workers, http: aiohttp.ClientSession
) -> None:
    # Read whole and parsed on the event loop, it stalled every request at each scrape.
    workers.mode["a"] = "huge"
    scraper = make(workers, http, FakeClock())
    assert not await scraper.scrape_once("a")
    snap = scraper.snapshot("a")
    assert snap.stale and snap.metrics is None
    assert snap.last_error == f"page over {MAX_PAGE_BYTES} bytes"


async def test_connection_refused_is_counted(http: aiohttp.ClientSession) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The port is closed again: connecting is refused.
    scraper = VllmScraper([("gone", f"http://127.0.0.1:{port}")], http, clock=FakeClock())
    assert await scraper.scrape_once("gone") is False
    assert await scraper.scrape_once("gone") is False
    snap = scraper.snapshot("gone")
    assert snap.scrape_errors == 2 and snap.stale
    assert snap.last_error is not None and "ClientConnectorError" in snap.last_error


async def test_callback_per_sample_and_a_failing_callback_is_contained(
    workers: Workers, http: aiohttp.ClientSession
) -> None:
    seen: list[tuple[str, WorkerMetrics, WorkerRates]] = []

    def on_sample(name: str, m: WorkerMetrics, r: WorkerRates) -> None:
        seen.append((name, m, r))
        raise RuntimeError("subscriber bug")

    clock = FakeClock()
    scraper = VllmScraper([("a", workers.url("a"))], http, clock=clock, on_sample=on_sample)
    assert await scraper.scrape_once("a")
    clock.t += 0.2
    assert await scraper.scrape_once("a")
    assert [(n, m.sampled_at) for n, m, _ in seen] == [("a", 1000.0), ("a", 1000.2)]
    assert seen[1][2].interval_s == pytest.approx(0.2)
    assert scraper.snapshot("a").scrape_errors == 0


async def test_an_idle_worker_is_scraped_at_the_idle_period(
    workers: Workers, http: aiohttp.ClientSession
) -> None:
    workers.mode["a"] = "idle"  # b serves the busy page (requests running and queued)
    busy = {"a": False, "b": False}
    scraper = make(workers, http, FakeClock(), period_s=0.01, idle_period_s=5.0,
                   stale_after_s=10.0, busy=busy.__getitem__)
    await scraper.start()
    try:
        await wait_until(lambda: workers.hits.get("b", 0) >= 30, "b scraped 30 times")
        assert (scraper.period("a"), scraper.period("b")) == (5.0, 0.01)
        assert workers.hits["a"] == 1  # the first scrape; the next is five seconds away
        snap = scraper.snapshot("a")
        assert snap.metrics is not None and snap.metrics.running == 0
        # A call starts on a: it is scraped every period_s again, without sleeping out the
        # idle period it was in.
        busy["a"] = True
        assert scraper.period("a") == 0.01
        await wait_until(lambda: workers.hits["a"] >= 10, "a scraped fast while busy")
        # The page is asked for uncompressed: gzip would cost the engine CPU.
        assert workers.encodings == {"identity"}
    finally:
        await scraper.stop()


async def test_reads_the_filtered_page_where_served_else_the_whole(
    workers: Workers, http: aiohttp.ClientSession
) -> None:
    workers.mode["b"] = "no-filter"  # b answers /metrics/ with 404, as a non-vLLM server may
    clock = FakeClock()
    scraper = make(workers, http, clock)
    for _ in range(3):
        assert await scraper.scrape_once("a") and await scraper.scrape_once("b")
    # a: the filtered page every time, naming every series the parser reads; never the whole.
    assert workers.filtered_hits["a"] == workers.hits["a"] == 3
    assert tuple(workers.names) == READ_NAMES
    # b: tried once, then the whole page only.
    assert workers.filtered_hits["b"] == 1 and workers.hits["b"] == 1 + 3
    a, b = scraper.snapshot("a").metrics, scraper.snapshot("b").metrics
    assert a is not None and a == replace(b, sampled_at=a.sampled_at)  # the same sample
    assert scraper.snapshot("b").scrape_errors == 0


async def test_a_server_failing_both_ways_gets_one_request_per_scrape_then_the_filter_again(
    workers: Workers, http: aiohttp.ClientSession
) -> None:
    workers.mode["a"] = "500"  # e.g. a server still starting
    scraper = make(workers, http, FakeClock())
    for _ in range(3):
        assert not await scraper.scrape_once("a")
    # The filtered page once, then the whole page only: 1 + 3 requests, not 6.
    assert workers.filtered_hits["a"] == 1 and workers.hits["a"] == 4
    assert scraper.reads_filtered("a") is False
    workers.mode["a"] = "ok"
    assert await scraper.scrape_once("a")  # recovered, on the whole page
    assert await scraper.scrape_once("a")  # and the filtered page is tried again: served
    assert scraper.reads_filtered("a") is True and workers.filtered_hits["a"] == 2


async def test_from_config_and_unique_names(http: aiohttp.ClientSession) -> None:
    cfg = VllmProbeConfig(period_s=0.1, idle_period_s=1.5, timeout_s=0.3, stale_after_s=2.0)
    s = VllmScraper.from_config(cfg, [("x", "http://127.0.0.1:1/")], http)
    assert (s.period_s, s.timeout_s, s.stale_after_s) == (0.1, 0.3, 2.0)
    assert s.pace.idle_period_s == 1.5
    assert s.workers == ("x",)
    with pytest.raises(ValueError, match="unique"):
        VllmScraper([("x", "http://a"), ("x", "http://b")], http)


async def test_kv_geometry_read_once_and_again_after_a_restart(
    http: aiohttp.ClientSession,
) -> None:
    page = PAGE.read_text()
    served = {"page": page}

    async def metrics(request: web.Request) -> web.StreamResponse:
        return web.Response(text=served["page"], content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        clock = FakeClock()
        scraper = VllmScraper(
            [("w", str(server.make_url("")).rstrip("/"))], http, clock=clock,
            period_s=1.0, timeout_s=2.0, stale_after_s=5.0,
        )
        assert await scraper.scrape_once("w")
        first = scraper.snapshot("w").metrics
        assert first is not None and first.num_gpu_blocks == 160
        # Same process, new geometry on the page: not re-read (the line is skipped).
        served["page"] = page.replace('num_gpu_blocks="160"', 'num_gpu_blocks="999"')
        clock.t += 1.0
        assert await scraper.scrape_once("w")
        assert scraper.snapshot("w").metrics.num_gpu_blocks == 160  # type: ignore[union-attr]
        # A restart (new process start time) makes the next scrape read it again.
        served["page"] = served["page"].replace(
            "process_start_time_seconds 1.79594013576e+09",
            "process_start_time_seconds 1.79594099999e+09",
        )
        clock.t += 1.0
        assert await scraper.scrape_once("w")
        clock.t += 1.0
        assert await scraper.scrape_once("w")
        assert scraper.snapshot("w").metrics.num_gpu_blocks == 999  # type: ignore[union-attr]
    finally:
        await server.close()
