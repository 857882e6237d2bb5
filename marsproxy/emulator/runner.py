"""The asyncio driver of the pure engine: steps it, sleeps the modelled step time (scaled), and
hands tokens to the waiting HTTP handlers.

Time: the engine runs on a MODELLED clock (seconds of the profile's GPU). Wall time relates to it
by ``time_scale`` (wall seconds per modelled second). After an idle period the modelled clock
jumps forward to the wall clock, so arrivals, queueing and latencies line up with what clients
see (divided by ``time_scale``). Sleeps target absolute deadlines so rounding does not drift.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from marsproxy.emulator.engine import Engine, Policy, StepResult
from marsproxy.emulator.kv_events import KVEventPublisher, KVEventsConfig
from marsproxy.emulator.metrics import EmulatorMetrics
from marsproxy.emulator.profiles import EngineProfile
from marsproxy.emulator.request import FinishedEvent

log = logging.getLogger(__name__)


@dataclass
class TokenStream:
    """What a handler waits on: how many tokens are out, and the finish event once done."""

    req_id: str
    available: int = 0
    finished: FinishedEvent | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)


class EngineRunner:
    def __init__(
        self, profile: EngineProfile, policy: Policy, time_scale: float,
        kv_events: KVEventsConfig | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.profile = profile
        self.engine = Engine(profile, policy)
        self.metrics = EmulatorMetrics(profile)
        self.time_scale = time_scale
        self._streams: dict[str, TokenStream] = {}
        self.server_load = 0  # generation requests the HTTP handlers are serving
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._model_now = 0.0
        self.kv_events = kv_events
        self._publisher: KVEventPublisher | None = None

    # -- clock -------------------------------------------------------------------------------
    def _wall_model(self) -> float:
        return (asyncio.get_running_loop().time() - self._t0) / self.time_scale

    def model_now(self) -> float:
        """Current modelled time: the engine clock, or the wall clock when the engine idles."""
        return max(self._model_now, self._wall_model())

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._t0 = asyncio.get_running_loop().time()
        if self.kv_events is not None and self.kv_events.publishes:
            self.engine.kv.record_events()
            self._publisher = KVEventPublisher(self.kv_events, self.profile.block_size)
            self._publisher.start()
        self._task = asyncio.create_task(self._run(), name="emulator-engine")
        self._task.add_done_callback(_log_crash)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._publisher is not None:
            await self._publisher.stop()
            self._publisher = None

    # -- requests ----------------------------------------------------------------------------
    def submit(
        self, req_id: str, prompt: list[int], max_tokens: int | None, ignore_eos: bool,
        priority: int, session_id: str | None = None, event: asyncio.Event | None = None,
    ) -> TokenStream:
        """Queue a request (raises ``RequestError``) and return the stream to wait on; the
        streams of one HTTP request's choices share its ``event``."""
        # A busy engine's clock is the truth for arrivals (it may lag the wall clock when the
        # host is slow); an idle engine restarts at the arrival, so no step starts before it.
        if self.engine.has_work():
            now = self._model_now
        else:
            now = self._model_now = self.model_now()
        self.engine.add_request(
            req_id, prompt, max_tokens, ignore_eos=ignore_eos, priority=priority, now=now,
            session_id=session_id,
        )
        stream = TokenStream(req_id) if event is None else TokenStream(req_id, event=event)
        self._streams[req_id] = stream
        self._wake.set()
        return stream

    def release(self, req_id: str) -> None:
        """The handler is done with ``req_id``; abort it in the engine if still running."""
        self._streams.pop(req_id, None)
        if self.engine.abort(req_id, self.model_now()):
            self.metrics.success["abort"].inc()
            self._wake.set()  # freed blocks may let a waiting request start

    # -- loop --------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        eng = self.engine
        while True:
            if not eng.has_work():
                self._wake.clear()
                await self._wake.wait()
                self._model_now = max(self._model_now, self._wall_model())
            q0, h0 = eng.kv.stats.queries, eng.kv.stats.hits
            result = eng.step(self._model_now)
            if result.batch.num_tokens == 0:
                # Nothing schedulable (should not happen); wait for a change instead of spinning.
                self._wake.clear()
                await self._wake.wait()
                continue
            self._model_now += result.duration
            delay = self._t0 + self._model_now * self.time_scale - loop.time()
            # sleep(0) still yields, so handlers write while the engine is saturated.
            await asyncio.sleep(max(delay, 0.0))
            self._deliver(result)
            if self._publisher is not None:  # one batch per step, as vLLM's scheduler
                self._publisher.publish(eng.kv.take_events())
            self.metrics.record_step(
                result, eng.stats(), (eng.kv.stats.queries - q0, eng.kv.stats.hits - h0)
            )

    def _deliver(self, result: StepResult) -> None:
        streams = self._streams
        for req_id in result.new_tokens:
            stream = streams.get(req_id)
            if stream is not None:
                stream.available += 1
                stream.event.set()
        for fin in result.finished:
            stream = streams.get(fin.req_id)
            if stream is not None:
                stream.finished = fin
                stream.event.set()


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("emulator engine loop died", exc_info=task.exception())
