"""The asyncio shell around :mod:`marsproxy.probes.vllm_metrics`: scrape every worker's
``/metrics`` periodically and keep the latest sample and rates of each, slower while a worker
is idle (:mod:`marsproxy.probes.scrape_pace`).

Each worker has its own task, so a slow or hung worker delays nobody else. Errors (connect
failures, timeouts, non-200, unparseable pages) are counted per worker and never reach callers;
the worker simply stops getting fresh samples and turns stale, which the policy treats as
saturated (fail closed). Once per server process it also reads ``/v1/models`` for the longest
context the worker serves (vLLM's ``max_model_len``), which caps admission's forecasts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlencode

import aiohttp

from marsproxy.probes.config import VllmProbeConfig
from marsproxy.probes.scrape_pace import ScrapePace
from marsproxy.probes.vllm_metrics import (
    READ_NAMES,
    MetricsParseError,
    WorkerMetrics,
    parse_vllm_metrics,
)
from marsproxy.probes.vllm_rates import MetricsTracker, WorkerRates

log = logging.getLogger(__name__)

_IDENTITY = {"Accept-Encoding": "identity"}
# A vLLM 0.32 page is ~50 KB (the whole page, one engine). A larger answer is no metrics page
# worth reading: parsing tens of MB would block the event loop at every scrape.
MAX_PAGE_BYTES = 4 << 20

SampleCallback = Callable[[str, WorkerMetrics, WorkerRates], None]
"""Called with (worker name, sample, rates) after every good scrape."""


@dataclass(frozen=True, slots=True)
class WorkerPressure:
    """What the scraper knows about one worker at one instant."""

    worker: str
    metrics: WorkerMetrics | None
    """The last good sample; ``None`` before the first one."""
    rates: WorkerRates
    stale: bool
    """No good sample within ``stale_after_s``: treat the worker as saturated."""
    age_s: float | None
    """Seconds since the last good sample (``None``: never had one)."""
    scrape_errors: int
    last_error: str | None
    max_model_len: int | None = None
    """The longest context the worker serves (``/v1/models``); ``None``: not reported."""

    @property
    def kv_usage_fail_closed(self) -> float:
        """KV usage for admission decisions: 1.0 (full) when stale or unknown."""
        if self.stale or self.metrics is None or self.metrics.kv_usage is None:
            return 1.0
        return self.metrics.kv_usage


class _WorkerState:
    __slots__ = ("cache_config", "errors", "failing", "filtered", "last_error", "max_model_len",
                 "model_len_read", "models_url", "name", "tracker", "url", "url_filtered")

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.url = url.rstrip("/") + "/metrics"
        # vLLM serves prometheus_client's own app under /metrics/ (trailing slash), which
        # renders only the series named in name[]; /metrics is the whole page.
        self.url_filtered = self.url + "/?" + urlencode([("name[]", n) for n in READ_NAMES])
        self.filtered: bool | None = None
        """Whether the filtered page serves this worker (``None``: to be tried)."""
        self.tracker = MetricsTracker()
        self.errors = 0
        self.last_error: str | None = None
        self.failing = False
        # (block_size, num_gpu_blocks) of the running server process; re-read after a restart.
        self.cache_config: tuple[int | None, int | None] | None = None
        self.models_url = url.rstrip("/") + "/v1/models"
        self.max_model_len: int | None = None
        self.model_len_read = False  # /v1/models answered since the server process started


class VllmScraper:
    """Scrapes ``/metrics`` of each ``(name, base_url)`` worker every ``period_s``, or every
    ``idle_period_s`` while it is idle: it runs and queues nothing, and ``busy(name)`` (the
    proxy's calls in flight there, sessions waiting for it) is false.

    ``clock`` stamps samples and judges staleness (inject a fake one in tests); the pacing of
    scrapes uses the event loop's own timer.
    """

    def __init__(
        self,
        workers: Sequence[tuple[str, str]],
        http: aiohttp.ClientSession,
        *,
        period_s: float = 0.2,
        idle_period_s: float | None = None,
        timeout_s: float = 0.5,
        stale_after_s: float = 2.5,
        clock: Callable[[], float] = time.monotonic,
        on_sample: SampleCallback | None = None,
        busy: Callable[[str], bool] | None = None,
    ) -> None:
        """``idle_period_s``: ``None`` (or not above ``period_s``), always ``period_s``."""
        names = [name for name, _ in workers]
        if len(set(names)) != len(names):
            raise ValueError(f"worker names must be unique, got {names}")
        self._workers = {name: _WorkerState(name, url) for name, url in workers}
        self._http = http
        self.pace = ScrapePace(period_s, max(period_s, idle_period_s or period_s))
        self._busy = busy
        self.timeout_s = timeout_s
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._on_sample = on_sample
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def from_config(
        cls,
        cfg: VllmProbeConfig,
        workers: Sequence[tuple[str, str]],
        http: aiohttp.ClientSession,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_sample: SampleCallback | None = None,
        busy: Callable[[str], bool] | None = None,
    ) -> VllmScraper:
        return cls(
            workers,
            http,
            period_s=cfg.period_s,
            idle_period_s=cfg.idle_period_s,
            timeout_s=cfg.timeout_s,
            stale_after_s=cfg.stale_after_s,
            clock=clock,
            on_sample=on_sample,
            busy=busy,
        )

    @property
    def period_s(self) -> float:
        return self.pace.period_s

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(self._workers)

    @property
    def running(self) -> bool:
        return bool(self._tasks)

    async def start(self) -> None:
        """Start one scrape loop per worker (idempotent)."""
        if self._tasks:
            return
        self._tasks = [
            asyncio.create_task(self._loop(state), name=f"vllm-scrape-{state.name}")
            for state in self._workers.values()
        ]

    async def stop(self) -> None:
        """Cancel the loops and wait for them to end."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def scrape_once(self, name: str) -> bool:
        """Scrape one worker now; True on a good sample. Never raises (but cancellation)."""
        state = self._workers[name]
        started = self._clock()
        try:
            async with asyncio.timeout(self.timeout_s):
                sample = await self._read(state, started)
        except (TimeoutError, aiohttp.ClientError, OSError, MetricsParseError, _ScrapeError) as exc:
            self._record_error(state, exc)
            return False
        rates = state.tracker.update(sample)
        if rates.restarted:
            # A restarted server may have a new KV geometry, or a new version and routes.
            state.cache_config = None
            state.filtered = None
            state.model_len_read = False  # it may serve another model, or other lengths
        elif state.cache_config is None and sample.block_size is not None:
            state.cache_config = (sample.block_size, sample.num_gpu_blocks)
        if state.failing:
            state.failing = False
            if state.filtered is False:  # it may have failed both ways: try the filter again
                state.filtered = None
            log.info("vllm scrape of %s recovered after %d errors", name, state.errors)
        if not state.model_len_read:
            await self._read_model_len(state)
        if self._on_sample is not None:
            try:
                self._on_sample(name, sample, rates)
            except Exception:
                # A broken subscriber must not stop the scraping that fail-closed relies on.
                log.exception("on_sample callback failed for worker %s", name)
        return True

    async def _read(self, state: _WorkerState, started: float) -> WorkerMetrics:
        """The worker's sample: from the filtered page where it serves one, else the whole."""
        if state.filtered is False:
            return await self._get(state, state.url, started)
        try:
            sample = await self._get(state, state.url_filtered, started)
        except (MetricsParseError, _ScrapeError) as exc:
            # It answered, not with a metrics page: a server without the filtered route (or
            # one failing both ways, which then gets one request per scrape, not two).
            state.filtered = False
            sample = await self._get(state, state.url, started)
            log.info("vllm scrape of %s: no filtered /metrics/ page (%s); reading the whole"
                     " page", state.name, exc)
            return sample
        state.filtered = True
        return sample

    async def _get(self, state: _WorkerState, url: str, started: float) -> WorkerMetrics:
        # Uncompressed: next to the engine the bytes are cheap, compressing them is not.
        async with self._http.get(url, headers=_IDENTITY) as resp:
            if resp.status != 200:
                raise _ScrapeError(f"HTTP {resp.status}")
            chunks, size = [], 0
            async for chunk in resp.content.iter_chunked(1 << 16):
                size += len(chunk)
                if size > MAX_PAGE_BYTES:
                    raise _ScrapeError(f"page over {MAX_PAGE_BYTES} bytes")
                chunks.append(chunk)
            body = b"".join(chunks)
        # Stamp with the send time: the page shows the state when the request arrived, and
        # the earlier stamp errs on the side of staleness.
        return parse_vllm_metrics(
            body.decode("utf-8", errors="replace"), started,
            known_cache_config=state.cache_config,
        )

    async def _read_model_len(self, state: _WorkerState) -> None:
        """``max_model_len`` from ``/v1/models``; an error is tried again after the next
        scrape, a server without the route or the field leaves it unknown."""
        problem, doc = None, None
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._http.get(state.models_url) as resp:
                    if resp.status >= 500:
                        problem = f"HTTP {resp.status}"
                    elif resp.status == 200:
                        doc = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            problem = repr(exc)
        if problem is not None:
            # Debug only: a worker whose route keeps failing would log at every scrape.
            log.debug("%s of %s not read (tried again after the next scrape): %s",
                      state.models_url, state.name, problem)
            return
        state.model_len_read = True
        state.max_model_len = longest_context(doc)
        if state.max_model_len is not None:
            log.info("worker %s serves contexts up to %d tokens", state.name,
                     state.max_model_len)

    def snapshot(self, name: str) -> WorkerPressure:
        """The latest state of worker ``name`` (KeyError for an unknown name)."""
        state = self._workers[name]
        latest = state.tracker.latest
        now = self._clock()
        return WorkerPressure(
            worker=name,
            metrics=latest,
            rates=state.tracker.rates,
            stale=state.tracker.is_stale(now, self.stale_after_s),
            age_s=None if latest is None else now - latest.sampled_at,
            scrape_errors=state.errors,
            last_error=state.last_error,
            max_model_len=state.max_model_len,
        )

    def reads_filtered(self, name: str) -> bool | None:
        """Whether worker ``name`` serves the filtered page (``None``: not known yet)."""
        return self._workers[name].filtered

    def period(self, name: str) -> float:
        """Seconds from the start of this scrape of worker ``name`` to the next."""
        state = self._workers[name]
        busy = self._busy is not None and self._busy(name)
        return self.pace.period(state.tracker.latest, failing=state.failing, busy=busy)

    def snapshots(self) -> dict[str, WorkerPressure]:
        return {name: self.snapshot(name) for name in self._workers}

    async def _loop(self, state: _WorkerState) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await self.scrape_once(state.name)
            await self.wait_next(state.name, began)

    async def wait_next(self, name: str, began: float) -> None:
        """Sleep until the next scrape of ``name`` is due; ``began``: the loop time the last
        one started. A scrape longer than the period is followed by the next at once (after a
        yield to the loop). An idle period is slept in steps of ``period_s``, so a worker that
        a call starts on is scraped again within ``period_s``."""
        loop = asyncio.get_running_loop()
        left = self.period(name) - (loop.time() - began)
        while True:
            await asyncio.sleep(max(0.0, min(left, self.period_s)))
            left = self.period(name) - (loop.time() - began)
            if left <= 0:
                return

    def _record_error(self, state: _WorkerState, exc: BaseException) -> None:
        state.errors += 1
        if isinstance(exc, _ScrapeError):
            state.last_error = str(exc)
        else:
            state.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if not state.failing:
            # Log the first error of a run only; at 5 scrapes/s every error would flood.
            state.failing = True
            log.warning(
                "vllm scrape of %s (%s) failed: %s", state.name, state.url, state.last_error
            )


def longest_context(models: object) -> int | None:
    """The largest ``max_model_len`` in a ``/v1/models`` answer (vLLM lists its model and its
    adapters, all alike); ``None`` where none is given."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        return None
    lengths = [m.get("max_model_len") for m in data if isinstance(m, dict)]
    return max((n for n in lengths if type(n) is int and n > 0), default=None)


class _ScrapeError(Exception):
    """A response that is not a metrics page (non-200 status, too large)."""
