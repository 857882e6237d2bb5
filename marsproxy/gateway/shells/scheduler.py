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
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from marsproxy.config import MarsConfig, WorkerConfig
from marsproxy.core.kv import PromptEstimator
from marsproxy.gateway.http.bodies import splice_new_key
from marsproxy.gateway.http.sse import Usage
from marsproxy.gateway.shells.metrics import GatewayMetrics
from marsproxy.gateway.shells.priority_probe import probe_priority
from marsproxy.gateway.shells.telemetry import Telemetry
from marsproxy.sched.core import SchedulerCore
from marsproxy.sched.hints import apply_vllm_priority, encode
from marsproxy.sched.ledger import Reservation
from marsproxy.sched.tickets import EndResult, Ticket, WorkerFacts

log = logging.getLogger("marsproxy.gateway.shells.scheduler")

_PROBE_ATTEMPTS = 3  # a probe that could not talk to the worker is tried again ...
_PROBE_RETRY_S = 2.0  # ... this much later


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
        telemetry: Telemetry,
        metrics: GatewayMetrics,
    ) -> None:
        self.cfg, self.scfg = cfg, cfg.scheduler
        self.telemetry, self.metrics = telemetry, metrics
        self.workers: dict[str, WorkerConfig] = {w.label: w for w in cfg.workers}
        self.label_of = {w.url: w.label for w in cfg.workers}
        self.core = SchedulerCore(cfg.scheduler, list(self.workers), cfg.admission.kv_reserve_frac)
        self.estimator = PromptEstimator(cfg.admission.tuning.chars_per_token)
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
        self.passive = (not self.core.enabled and self.scfg.retention_policy == "off"
                        and self.scfg.hint_encoder == "none")
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    @staticmethod
    def now() -> float:
        return time.monotonic()

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._tick_loop(), name="marsproxy-sched-tick"))
        if self.core.enabled:
            for w in self.cfg.workers:
                if w.priority == "auto":
                    self._tasks.append(asyncio.create_task(
                        self._probe(w), name=f"marsproxy-priority-probe-{w.label}"))

    async def stop(self) -> None:
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
        for label, w in self.workers.items():
            self.core.set_facts(label, self._facts(label, w))
        res = self.core.tick(self.now())
        self._count_released(res.expired, "expired")
        self._count_released(res.dropped, "pressure")
        self._wake(self.core.release(self.now()))

    def _facts(self, label: str, w: WorkerConfig) -> WorkerFacts:
        p = self.telemetry.worker_pressure(label)
        m = None if p is None else p.metrics
        prefill = None if p is None else p.rates.prefill_tokens_per_s
        return WorkerFacts(
            max_num_seqs=w.max_num_seqs,
            total_blocks=None if m is None else m.num_gpu_blocks,
            block_size=None if m is None else m.block_size,
            prefill_tokens_per_s=prefill,
            kv_usage=None if m is None or p is None or p.stale else m.kv_usage,
        )

    # -- the request path -----------------------------------------------------------------
    async def prepare(
        self, session: str, url: str, body: dict[str, Any], raw: bytes
    ) -> Prepared:
        """Schedule one continuation for the worker at ``url``: its level, a wait in the gated
        queue if the worker's gate is closed, then the body and headers that go upstream."""
        if self.passive:
            return Prepared(None, raw, {}, "none")
        label = self.label_of[url]
        chars = len(raw)
        est = self.estimator.estimate(session, chars)
        max_new = body.get("max_tokens") or body.get("max_completion_tokens") or 0
        tracker = self.telemetry.tracker
        t = self.core.arrive(
            self.now(), session, label, est,
            max_new_tokens=max_new if isinstance(max_new, int) else 0,
            predicted_tool_s=tracker.predicted_duration(session),
        )
        self.metrics.continuations.labels("none" if t.level is None else str(t.level)).inc()
        if t.gated:
            self._wake(self.core.release(self.now(), [label]))
            if not t.dispatched:
                await self._wait(t)
            self.metrics.dispatch_wait.observe(t.waited_s())
        return self._hints(t, body, raw, chars)

    async def _wait(self, t: Ticket) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[t.call] = fut
        try:
            await fut
        except asyncio.CancelledError:
            # The client left while held (or just as it was released): free what it holds.
            self._waiters.pop(t.call, None)
            self.core.cancel(t.call)
            self._wake(self.core.release(self.now(), [t.worker]))
            raise

    def _wake(self, released: list[Ticket]) -> None:
        for t in released:
            fut = self._waiters.pop(t.call, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _hints(self, t: Ticket, body: dict[str, Any], raw: bytes, chars: int) -> Prepared:
        headers: dict[str, str] = {}
        parts: list[str] = []
        edited = False
        if self.core.modes[t.worker] == "priority" and t.priority is not None:
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
            raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        return Prepared(t, raw, headers, " ".join(parts) or "none", chars)

    def moved(self, p: Prepared, url: str) -> None:
        """The relay failed over to another worker."""
        if p.ticket is not None:
            self.core.moved(p.ticket.call, self.label_of[url])

    def ended(
        self, p: Prepared, *, ok: bool, usage: Usage | None, engine_s: float,
        session_continues: bool,
    ) -> EndResult | None:
        """The call is over (well or not): service, resume accounting, retention decision."""
        t = p.ticket
        if t is None:
            return None
        u = usage or Usage()
        if ok and u.prompt_tokens > 0:
            self.estimator.observe(t.session, p.chars, u.prompt_tokens)
        tel = self.telemetry
        res = self.core.end(
            self.now(), t.call, ok=ok and usage is not None, prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
            engine_s=engine_s, predicted_tool_s=tel.tracker.predicted_duration(t.session),
            session_continues=session_continues,
        )
        m = self.metrics
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
        self._wake(self.core.release(self.now(), [t.worker]))
        return res

    def session_ended(self, session: str) -> None:
        returned = self.core.session_ended(session)
        self.estimator.forget(session)
        if returned is not None:
            self._count_released([returned], "session_end")

    def _count_released(self, rs: list[Reservation], reason: str) -> None:
        for r in rs:
            self.metrics.ledger_released.labels(r.worker, reason).inc()

    # -- reading --------------------------------------------------------------------------
    def retained_blocks(self, label: str) -> int:
        return self.core.retained_blocks(label)

    def mode(self, label: str) -> str:
        """What the state shows: the worker's mode, or off when the policy has no levels."""
        return self.core.modes[label] if self.core.enabled else "off"
