"""The gateway's information stream: one event bus, the probes that feed it, and its sinks.

Built from config by the gateway and started/stopped with the app. Probes never raise into the
request path: a worker whose ``/metrics`` fails turns stale (saturated), NVML off or missing is
one log line, and a failing sink drops events. Event timestamps are wall-clock seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import aiohttp

from marsproxy.config import MarsConfig
from marsproxy.core.events import (
    Event,
    PressureSample,
    Rejected,
    SessionAdmitted,
    SessionEnd,
    ToolEnd,
)
from marsproxy.core.session_record import EndReason
from marsproxy.gateway.shells.metrics import GatewayMetrics
from marsproxy.probes.cpu import CpuPressure, CpuProbe
from marsproxy.probes.nvml import GpuPressure, NvmlProbe
from marsproxy.probes.poller import Poller, daemon_call
from marsproxy.probes.tool_signal import tool_plane
from marsproxy.probes.vllm_scraper import VllmScraper, WorkerPressure
from marsproxy.telemetry.bus import EventBus
from marsproxy.telemetry.sinks import JsonlSink, RedisStreamSink

log = logging.getLogger("marsproxy.telemetry")


class _Sink(Protocol):
    def start(self) -> None: ...
    async def stop(self) -> None: ...


class Telemetry:
    def __init__(self, cfg: MarsConfig, metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.bus = EventBus(cfg.telemetry.bus_capacity)
        self.worker_names = [w.label for w in cfg.workers]
        self.cpu_probe = CpuProbe.from_config(cfg.probes.cpu)
        self.cpu: Poller[CpuPressure] = Poller(
            "cpu", self.cpu_probe.read, cfg.probes.cpu.period_s
        )
        self.nvml = NvmlProbe.from_config(cfg.probes.nvml)
        # NVML calls can block on a wedged driver: read them off the event loop.
        self.gpu: Poller[dict[str, GpuPressure]] = Poller(
            "nvml", self.nvml.read_all, cfg.probes.nvml.period_s, in_thread=True
        )
        self.tracker, self.tool_signal = tool_plane(cfg.tools, self.cpu_probe.tool_cpus)
        self.scraper: VllmScraper | None = None  # needs a client session: built in start()
        self.busy: Callable[[str], bool] = lambda _worker: False
        """Whether the proxy has calls in flight on a worker or sessions waiting for it (its
        scrapes stay fast then); set before :meth:`start`."""
        self.scraped: Callable[[], None] = lambda: None
        """Called after each scrape attempt of any worker (admission: the first requests after
        start wait for the first scrape, not for the next control tick)."""
        self._http: aiohttp.ClientSession | None = None
        self._redis: Any = None
        self._sinks: list[_Sink] = []
        self._tasks: list[asyncio.Task[None]] = []

    @staticmethod
    def wall() -> float:
        """Event timestamps and the tool tracker's clock (explicit events carry epoch seconds)."""
        return time.time()

    def publish_decided(self, events: list[Event], to_wall: float) -> None:
        """The control plane's events (its clock + ``to_wall`` = wall time). Rejections are
        published by the relay when it answers, admissions once the store confirmed them; a
        session's FINAL end by the session table that forgets it next; MOVED is no end (another
        replica serves the session now)."""
        for ev in events:
            if isinstance(ev, Rejected | SessionAdmitted):
                continue
            if isinstance(ev, SessionEnd) and ev.reason in (EndReason.FINAL, EndReason.MOVED):
                continue
            if not self.bus.subscribers:
                self.bus.skip()  # nobody to read it: not rebuilt
                continue
            self.publish(replace(ev, ts=ev.ts + to_wall))

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        tcfg = self.cfg.telemetry
        if tcfg.jsonl_path:
            self._sinks.append(JsonlSink(self.bus, tcfg.jsonl_path))
        if tcfg.redis_stream.url:
            import redis.asyncio as aioredis  # only when configured

            self._redis = aioredis.Redis.from_url(tcfg.redis_stream.url)
            rs = tcfg.redis_stream
            self._sinks.append(RedisStreamSink(self.bus, self._redis, rs.key, rs.maxlen))
        for sink in self._sinks:
            sink.start()
        vcfg = self.cfg.probes.vllm
        # Its own small session: the relay's pool does not decompress, /metrics may be gzip.
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=vcfg.timeout_s),
            connector=aiohttp.TCPConnector(limit=max(4, 2 * len(self.worker_names))),
        )
        self.scraper = VllmScraper.from_config(
            vcfg, [(w.label, w.url) for w in self.cfg.workers], self._http,
            busy=self.busy,
        )
        self._tasks = [
            asyncio.create_task(self._scrape_loop(name), name=f"vllm-scrape-{name}")
            for name in self.worker_names
        ]
        await self.cpu.start()
        # NVML's start can block on a wedged driver as its reads can: nothing waits for it,
        # the GPU readings begin when it returns.
        self._tasks.append(asyncio.create_task(self._start_gpu(), name="nvml-start"))

    async def _start_gpu(self) -> None:
        if await daemon_call(self.nvml.start, "nvml-start")[1]:
            await self.gpu.start()

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.cpu.stop()
        await self.gpu.stop()
        daemon_call(self.nvml.stop, "nvml-stop")  # not awaited: a wedged driver never returns
        if self._http is not None:
            await self._http.close()
            self._http = None
        for sink in self._sinks:
            await sink.stop()  # the JSONL sink writes what is still queued
        self._sinks = []
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def _scrape_loop(self, name: str) -> None:
        # The scraper's own loop, plus a pressure_sample every Nth attempt (stale ones too,
        # so a worker that stops answering shows up in the stream as stale).
        assert self.scraper is not None
        loop = asyncio.get_running_loop()
        every = self.cfg.telemetry.pressure_sample_every
        n = 0
        while True:
            began = loop.time()
            await self.scraper.scrape_once(name)
            self.scraped()
            n += 1
            if n % every == 0:
                self.bus.publish(self._pressure_sample(self.scraper.snapshot(name)))
            await self.scraper.wait_next(name, began)

    def _pressure_sample(self, p: WorkerPressure) -> PressureSample:
        m = p.metrics
        cpu = self.cpu.latest
        return PressureSample(
            ts=self.wall(),
            worker=p.worker,
            kv_usage=None if m is None else m.kv_usage,
            running=None if m is None or m.running is None else float(m.running),
            waiting=None if m is None or m.waiting is None else float(m.waiting),
            stale=p.stale,
            cpu_some_avg10=None if cpu is None else cpu.psi_some_avg10,
            tools_in_flight=self.tracker.in_flight,
            backlog_ratio=self.tracker.backlog_ratio(self.wall()),
        )

    # -- publishing (request path: a dataclass and an append, nothing per subscriber) -----
    def publish(self, event: Event) -> None:
        self.bus.publish(event)

    def publish_tools(self, events: list[Event]) -> None:
        """Tracker output: tool_start/tool_end, with tool durations into the histogram."""
        for ev in events:
            if isinstance(ev, ToolEnd):
                self.metrics.tool_duration.labels(
                    "true" if ev.inferred else "false"
                ).observe(ev.duration_s)
            self.bus.publish(ev)

    def worker_pressure(self, name: str) -> WorkerPressure | None:
        return None if self.scraper is None else self.scraper.snapshot(name)

    def scrape_period(self, name: str) -> float | None:
        return None if self.scraper is None else self.scraper.period(name)
