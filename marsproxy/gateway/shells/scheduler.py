"""The scheduler shell: feeds the pure ``SchedulerCore`` and carries out what it decides.

Per continuation (between admission and the upstream request): the core gives it a level and
either lets it go or holds it in the worker's gated dispatch queue (the request waits here on a
future); then the level goes into the body's ``priority`` (priority workers) and the hint
encoder adds its headers/body keys. After the call: usage, the retention decision and its
``retention_decision`` event, and release of whatever the freed slot lets go. A tick loop keeps
the core's worker facts fresh from the scraper and expires or drops reservations. Workers
declared ``priority: auto`` are probed once at start (see :mod:`marsproxy.sched.probe`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from marsproxy.config import MarsConfig, WorkerConfig
from marsproxy.core.events import RetentionVerified
from marsproxy.gateway.http.bodies import dump_json, splice_new_key
from marsproxy.gateway.http.sse import Usage
from marsproxy.gateway.shells.deadlines import Alarm
from marsproxy.gateway.shells.metrics import GatewayMetrics
from marsproxy.gateway.shells.priority_probe import probe_priority
from marsproxy.gateway.shells.telemetry import Telemetry
from marsproxy.policy.observe import WorkerObservation
from marsproxy.policy.plane import CallEnd, ControlPlane
from marsproxy.sched.hints import apply_vllm_priority, encode
from marsproxy.sched.ledger import Reservation
from marsproxy.sched.tickets import EndResult, Ticket

log = logging.getLogger("marsproxy.gateway.shells.scheduler")

_PROBE_ATTEMPTS = 3  # a probe that could not talk to the worker is tried again ...
_PROBE_RETRY_S = 2.0  # ... this much later


def output_cap(body: dict[str, Any]) -> int:
    """The most tokens the request lets the engine write (0: none named, or unreadable):
    vLLM's chat takes ``max_completion_tokens`` over ``max_tokens``; ``/v1/responses`` names
    ``max_output_tokens``."""
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        v = body.get(key)
        if v is not None:
            return v if type(v) is int and v > 0 else 0
    return 0


class Rerouted(Exception):
    """A call held in a worker's gate left it because the worker was ejected: the caller
    places it anew (a healthy worker, or none: 503)."""


@dataclass(slots=True)
class Prepared:
    """What goes upstream for one continuation, and how it was scheduled."""

    ticket: Ticket | None  # None: nothing to schedule (fcfs preset, or no worker to go to)
    raw: bytes
    headers: dict[str, str]
    hint: str  # what was sent, for the dispatch event: "priority=1 headers", "gated headers"
    chars: int = 0


class SchedulerShell:
    def __init__(
        self,
        cfg: MarsConfig,
        plane: ControlPlane,
        telemetry: Telemetry,
        metrics: GatewayMetrics,
        observe: Callable[[], dict[str, WorkerObservation]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg, self.scfg = cfg, cfg.scheduler
        self.plane = plane
        self.telemetry, self.metrics = telemetry, metrics
        self.observe = observe
        self.now = clock
        self.workers: dict[str, WorkerConfig] = {w.label: w for w in cfg.workers}
        self.label_of = {w.url: w.label for w in cfg.workers}
        self.core = plane.scheduler
        self.mode_reason: dict[str, str] = {}
        for w in cfg.workers:
            if w.priority is True:
                self.core.set_mode(w.label, "priority")
                self.mode_reason[w.label] = "configured (priority: true)"
            elif w.priority == "auto" and self.core.enabled:
                self.mode_reason[w.label] = "auto: probe pending (gated until it decides)"
            elif not self.core.enabled:
                self.mode_reason[w.label] = "priority_policy off: no levels, no gating"
            else:
                self.mode_reason[w.label] = "configured (priority: false)"
        # Nothing to do per request: the fcfs preset is a plain session-affine proxy.
        self.passive = plane.passive
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        # A call held for a session due back goes when that wait ends (next_release_at).
        self._timer = Alarm(self.release_now)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._tick_loop(), name="marsproxy-sched-tick"))
        if self.core.enabled:
            for w in self.cfg.workers:
                if w.priority == "auto":
                    self._tasks.append(asyncio.create_task(
                        self._probe(w), name=f"marsproxy-priority-probe-{w.label}"))

    async def stop(self) -> None:
        self._timer.cancel()
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _probe(self, w: WorkerConfig) -> None:
        timeout = aiohttp.ClientTimeout(total=self.scfg.tuning.probe_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for attempt in range(_PROBE_ATTEMPTS):
                if attempt:  # a worker still starting fails to answer: give it a moment
                    await asyncio.sleep(_PROBE_RETRY_S)
                result = await probe_priority(http, w, self.scfg)
                if not result.failed:
                    break
        self.core.set_mode(w.label, "priority" if result.honours_priority else "gated")
        self.mode_reason[w.label] = "auto: " + result.reason
        self._wake(self.core.release(self.now()))  # anything held moves on in its new mode

    async def _tick_loop(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # a failed tick must not stop expiries for good
                log.exception("scheduler tick failed")
            await asyncio.sleep(self.scfg.tuning.tick_s)

    def tick(self) -> None:
        res, released = self.plane.sched_tick(self.now(), self.observe())
        self.kv_facts()
        self._count_released(res.expired, "expired")
        self._count_released(res.dropped, "pressure")
        self._wake(released)

    # -- the request path -----------------------------------------------------------------
    async def prepare(
        self, session: str, url: str, body: dict[str, Any], raw: bytes,
        tokens: int | None = None, body_priority: bool = True,
        resident_tokens: int | None = None, again: bool = False,
    ) -> Prepared:
        """Schedule one continuation for the worker at ``url``: its level, a wait in the gated
        queue if the worker's gate is closed, then the body and headers that go upstream;
        ``tokens``: the prompt's size when known (else estimated from the body's length);
        ``body_priority``: the route reads a body ``priority`` (vLLM's /v1/messages does not:
        such calls are released by the dispatch gate on every worker instead);
        ``resident_tokens``: its prefix resident there (KV events); ``again``: placed anew after
        its worker was ejected (counted once)."""
        if self.passive:
            return Prepared(None, raw, {}, "none")
        label = self.label_of[url]
        chars = len(raw)
        t = self.plane.call_start(self.now(), session, label, chars=chars, tokens=tokens,
                                  max_new_tokens=output_cap(body),
                                  gate=not body_priority, resident_tokens=resident_tokens)
        assert t is not None  # not passive
        try:
            self.kv_facts()
            if not again:
                self.metrics.continuations.labels(
                    "none" if t.level is None else str(t.level)).inc()
            if t.gated:
                self._wake(self.core.release(self.now(), [label]))
                if not t.dispatched:
                    await self._wait(t)  # a client that leaves frees the ticket there
                self.metrics.dispatch_wait.observe(t.waited_s())
            return self._hints(t, body, raw, chars)
        except Exception:
            # Failed before it went (e.g. a body the hints cannot serialize again): the
            # ticket leaves the gate, or its slot there would stay taken for good.
            self._wake(self.plane.cancel(self.now(), t))
            raise

    def kv_facts(self) -> None:
        """Publish and count what the plane verified and corrected by the KV index."""
        events, self.plane.kv_events = self.plane.kv_events, []
        wall = self.telemetry.wall() - self.now()
        for ev in events:
            w = ev.worker or ""
            if isinstance(ev, RetentionVerified):
                self.metrics.retention_verified.labels(w, ev.outcome).inc()
            else:
                self.metrics.retention_corrected.labels(w).inc()
            self.telemetry.publish(dataclasses.replace(ev, ts=ev.ts + wall))

    async def _wait(self, t: Ticket) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[t.call] = fut
        try:
            await fut
        except asyncio.CancelledError:
            # The client left while held (or just as it was released): free what it holds.
            self._waiters.pop(t.call, None)
            self._wake(self.plane.cancel(self.now(), t))
            raise

    def ejected(self, url: str) -> None:
        """The worker at ``url`` was ejected: the calls held in its gate raise
        :class:`Rerouted` (they would wait for calls there that may run on for long)."""
        for t in self.core.evict(self.label_of[url]):
            fut = self._waiters.pop(t.call, None)
            if fut is not None and not fut.done():
                fut.set_exception(Rerouted(t.worker))

    def _wake(self, released: list[Ticket]) -> None:
        for t in released:
            fut = self._waiters.pop(t.call, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        self._arm()

    def _arm(self) -> None:
        """Time the release of a call held for a session due back (``next_release_at``); only
        while the shell runs (started: a replay releases by itself)."""
        if self._tasks:
            self._timer.arm(self.core.next_release_at(), self.now())

    def release_now(self) -> None:
        """Send what the dispatch gate lets go now (a held call's wait is over)."""
        self._wake(self.core.release(self.now()))

    def _hints(self, t: Ticket, body: dict[str, Any], raw: bytes, chars: int) -> Prepared:
        headers: dict[str, str] = {}
        parts: list[str] = []
        edited = False
        if self.core.modes[t.worker] == "priority" and t.priority is not None and not t.gated:
            if "priority" in body:  # the client's own: kept or replaced, per config
                sent = apply_vllm_priority(body, t.priority, self.scfg.priority_override_client)
                edited = True
            else:  # the common case: spliced in, the body is not serialized again
                sent = t.priority
                raw = splice_new_key(raw, body, "priority", sent)
            parts.append(f"priority={sent}")
        elif t.gated:
            parts.append("gated")
        name = self.scfg.hint_encoder
        if name != "none":
            encode(name, t.session, t.level, t.retain_s, headers, body)
            parts.append(name)
            edited = edited or name == "dynamo"
        if edited:  # a nested or replaced key: serialize the edited parse once
            raw = dump_json(body)
        return Prepared(t, raw, headers, " ".join(parts) or "none", chars)

    def moved(self, p: Prepared, url: str) -> None:
        """The relay failed over to another worker."""
        if p.ticket is not None:
            self.core.moved(p.ticket.call, self.label_of[url])

    def finished(self, p: Prepared | None, end: CallEnd, usage: Usage | None) -> None:
        """The call is over (well or not): metrics, the retention event, and what the freed
        room lets go (even when the accounting fails: a worker's odd counts, say)."""
        try:
            self._account(p, end.result, usage)
        except Exception:
            log.exception("accounting of a finished call failed; what it frees goes on")
        self._wake(end.released)

    def _account(self, p: Prepared | None, res: EndResult | None, usage: Usage | None) -> None:
        if p is None or p.ticket is None or res is None:
            return
        t, u = p.ticket, usage or Usage()
        m, tel = self.metrics, self.telemetry
        if res.resume is not None:
            m.resumes.labels(res.resume, "true" if t.warm else "false").inc()
            m.resume_tokens.labels("cached").inc(min(u.cached_tokens, u.prompt_tokens))
            m.resume_tokens.labels("prompt").inc(u.prompt_tokens)
        out = res.retention
        if out is not None and self.scfg.retention_policy != "off":
            m.retention_decisions.labels("true" if out.retain else "false").inc()
            tel.publish(out.to_event(
                tel.wall(), t.session, t.worker, context_tokens=res.context_tokens,
                prefill_tokens_per_s=res.prefill_tokens_per_s,
                policy=self.scfg.retention_policy,
            ))

    def count_returned(self, rs: list[Reservation]) -> None:
        """Reservations given back because their session ended."""
        self._count_released(rs, "session_end")

    def _count_released(self, rs: list[Reservation], reason: str) -> None:
        for r in rs:
            self.metrics.ledger_released.labels(r.worker, reason).inc()

    # -- reading --------------------------------------------------------------------------
    def retained_blocks(self, label: str) -> int:
        return self.core.retained_blocks(label)

    def mode(self, label: str) -> str:
        """What the state shows: the worker's mode, or off when the policy has no levels."""
        return self.core.modes[label] if self.core.enabled else "off"
