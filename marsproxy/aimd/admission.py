"""The admission plane as one sans-IO object: events in, actions out.

:class:`AdmissionCore` ties the per-worker AIMD controllers, the admission queue, the KV fit
and the session lifecycle together. A driver calls ``on_*`` as requests arrive and end,
``tick`` every control interval and ``expire`` at ``next_deadline``, then carries out what
comes back. Invariant: a session is admitted onto a worker only while it holds fewer sessions
than its effective limit; a shrinking window evicts nobody; continuations are never held.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from marsproxy.aimd.config import AdmissionConfig, PlacementConfig
from marsproxy.aimd.controller import AimdController
from marsproxy.aimd.decisions import Actions, Decision, DecisionKind, Expiry
from marsproxy.aimd.fit import DEFAULT_BLOCK_SIZE, WorkerFit, WorkerSignals
from marsproxy.aimd.gauge import GaugeLag
from marsproxy.aimd.overlap import OverlapTracker
from marsproxy.aimd.peak import PeakForecast
from marsproxy.aimd.prefix import PrefixBook, prefer_prefix
from marsproxy.aimd.queue import Admission, AdmissionQueue
from marsproxy.aimd.yields import Yields
from marsproxy.core.events import (
    Rejected,
    SessionAdmitted,
    SessionEnd,
    SessionQueued,
)
from marsproxy.core.kv import PromptEstimator, blocks_for_tokens, fits, reprefill_seconds
from marsproxy.core.lifecycle import SessionLifecycle
from marsproxy.core.session_record import RAN_ITS_COURSE, EndReason, SessionState

# WorkerSignals is the core's input: importable from here with the core that reads it.
__all__ = ["Actions", "AdmissionCore", "Decision", "DecisionKind", "Expiry", "WorkerSignals"]


class AdmissionCore(WorkerFit):
    def __init__(self, cfg: AdmissionConfig, workers: Sequence[str],
                 placement: PlacementConfig | None = None) -> None:
        if not workers:
            raise ValueError("at least one worker is needed")
        self.cfg = cfg
        self.workers = tuple(workers)
        self.controllers = {w: AimdController(cfg, w) for w in self.workers}
        self.queue = AdmissionQueue(cfg)
        t = cfg.tuning
        self.peaks = PeakForecast(t.peak_growth_prior, t.peak_history, t.peak_min_samples)
        self.yields = Yields(cfg.classes, self.queue.shares.weight, self.queue.per_tenant,
                             one_shot=self.peaks.one_shot)
        self.queue.protected = self.yields.protected
        self.sessions = SessionLifecycle(
            cfg.idle_timeout_factor, cfg.idle_timeout_min_s, cfg.idle_timeout_max_s,
            t.kv_hold_min_s, return_history=t.return_history, one_shot_crowd=t.one_shot_crowd,
            hold_reprefill_factor=t.kv_hold_reprefill_factor)
        self.estimator = PromptEstimator(t.chars_per_token, t.estimate_history)
        self.overlaps = OverlapTracker(cfg, self.workers)
        self._signals: dict[str, WorkerSignals] = {w: WorkerSignals(stale=True) for w in workers}
        self.gauge = GaugeLag(self.workers)  # what the free-block gauge cannot show yet
        self.placement = placement or PlacementConfig()
        self.prefixes = PrefixBook(self.placement)  # waiting sessions' resident prefixes
        self._bound: dict[str, str] = {}  # session → the only worker it may go to
        if self.placement.policy == "prefix":
            self.queue.waits = self.prefixes.waits

    # -- requests -----------------------------------------------------------------------------
    def on_request(
        self, now: float, session: str, tenant: str, est_tokens: int, *, final: bool = False,
        cls: str | None = None, prefix: Mapping[str, int] | None = None, child: bool = False,
        bound: str | None = None,
    ) -> Decision:
        """A request arrives: serve it now, hold it, or reject it; ``cls``: a new session's
        class (``None``: the default); ``prefix``: its prompt's resident tokens per indexed
        worker (placement); ``child``: its parent is admitted (the children's lane, first);
        ``bound``: the only worker a new session may go to (it continues a reply kept there:
        no prefix placement, no relocation)."""
        rec = self.sessions.get(session)
        if rec is not None and rec.state is SessionState.ADMITTED:
            self.sessions.request(now, session, final)
            self.gauge.resumed(session)  # its blocks are in use again
            self.peaks.back(session)  # its forecast counts (again, after its hold); it grows
            self.yields.back(session)  # and it asks for its share again
            return Decision(DecisionKind.ADMITTED, worker=rec.worker, reason="continuation")
        if rec is not None:
            self.sessions.add_waiter(session, final)
            return Decision(DecisionKind.WAIT, reason="queued")
        if bound is not None:
            self._bound[session] = bound  # relocate() asks after the queue entry is gone
        if not self.cfg.enabled:
            return self._admit_unconditionally(now, session, tenant, est_tokens, final, prefix,
                                               bound)
        self.prefixes.note(session, None if bound is not None else prefix)
        entry = self.queue.entry(session, tenant, now, est_tokens, cls, child=child,
                                 grows=self._grows(tenant), bound=bound)
        # Nothing waits (every new session at light load): the pass's decision without its
        # lanes (AdmissionQueue.admit_alone), where its waiting would change no view.
        alone = not len(self.queue) and self.yields.single_tenant(tenant)
        if not alone and not self.queue.push(entry):
            self.prefixes.forget(session)
            # queue_full, class_over_share, tenant_over_share (retry at its share of the rate)
            reason = self.queue.refusal
            over = tenant if reason == "tenant_over_share" else None
            retry = self.queue.retry_after(now, tenant=over)
            ev = Rejected(ts=now, session=session, reason=reason, status=429)
            return Decision(DecisionKind.REJECT, status=429, retry_after_s=retry,
                            reason=reason, actions=Actions(events=[ev]))
        self.sessions.queue(now, session, tenant, est_tokens, entry.long, final)
        actions = Actions(events=[SessionQueued(ts=now, session=session,
                                                est_prompt_tokens=est_tokens)])
        if not alone:
            self._admit_pass(now, actions)
        else:
            # Its waiting changes no view: the views serve both ways.
            views = self._views(now)
            took = self.queue.admit_alone(entry, now, views)
            if took is not None:
                self._took(now, [took], actions)
            else:
                self.queue.push(entry)  # nothing waits: never refused (queue_max >= 1)
                self._took(now, self.queue.select(now, views), actions)
        mine = next((a for a in actions.admitted if a.entry.session == session), None)
        if mine is None:
            return Decision(DecisionKind.WAIT, reason="queued", actions=actions)
        actions.admitted.remove(mine)
        return Decision(DecisionKind.ADMITTED, worker=mine.worker, reason="admitted",
                        idle=mine.idle, actions=actions, entry=mine.entry)

    def on_adopt(
        self, now: float, session: str, tenant: str, worker: str, est_tokens: int, *,
        final: bool = False, turns: int = 0, correction: float | None = None,
    ) -> Decision:
        """A request of a session another replica admitted on ``worker`` (its live lease now
        this replica's): served there at once, not held, not a new admission."""
        if worker not in self.controllers:
            raise ValueError(f"unknown worker {worker!r}")
        if self.sessions.get(session) is not None:
            return self.on_request(now, session, tenant, est_tokens, final=final)
        if correction is not None:
            self.estimator.restore(session, correction)
        long = est_tokens > self.cfg.tuning.long_prompt_tokens
        self.sessions.adopt(now, session, tenant, worker, est_tokens, long, final=final,
                            turns=turns)
        self.peaks.admit(session, worker, est_tokens, grows=self._grows(tenant))
        self.yields.admitted(session, tenant, None)
        return Decision(DecisionKind.ADMITTED, worker=worker, reason="adopted")

    def relocate(self, now: float, session: str, candidates: Sequence[str]) -> str | None:
        """Move a session admitted but not served yet to a worker of ``candidates`` (free slots
        in the store, which refused its own; the store arbitrates the count, so only
        placeability and KV fit are checked): the one with most KV budget, ``None``: stay."""
        rec = self.sessions.get(session)
        if rec is None or rec.state is not SessionState.ADMITTED or rec.worker is None:
            return None
        if rec.turns > rec.in_flight or not self.gauge.is_promised(session):
            return None  # it was served there already: its prefix lives on that worker
        if session in self._bound:
            return None  # only its worker knows the reply it continues
        best: tuple[int, str] | None = None
        for v in self._views():
            if v.name == rec.worker or v.name not in candidates or not v.placeable:
                continue
            if rec.long and v.long_admitted >= self.cfg.tuning.max_long_in_flight:
                continue
            if not fits(blocks_for_tokens(rec.est_tokens, v.block_size), v.budget_blocks):
                continue
            rank = v.budget_blocks if v.budget_blocks is not None else 0
            if best is None or rank > best[0]:
                best = (rank, v.name)
        if best is None:
            return None
        self.move(session, best[1], rec.est_tokens)
        return best[1]

    def move(self, session: str, worker: str, est_tokens: int) -> None:
        """An admitted session not served yet goes to ``worker`` (its promise with it)."""
        self.sessions.move(session, worker)
        self.peaks.move(session, worker)
        self._promise(session, worker, est_tokens)

    def _grows(self, tenant: str) -> bool:  # its sessions come back (core/returns.py)
        return not self.sessions.returns.one_shot(tenant)

    def _promise(self, session: str, worker: str, est_tokens: int) -> None:
        block_size = self._signals[worker].block_size or DEFAULT_BLOCK_SIZE
        self.gauge.promise(session, worker, blocks_for_tokens(est_tokens, block_size))

    def on_response_end(
        self, now: float, session: str, *, prompt_chars: int | None = None,
        prompt_tokens: int | None = None, usual_tool_s: float | None = None,
        completion_tokens: int = 0, cached_tokens: int = 0,
    ) -> Actions:
        """A request of an admitted session finished (success, error or client gone)."""
        actions = Actions()
        rec = self.sessions.get(session)
        if rec is None or rec.state is not SessionState.ADMITTED:
            return actions
        # Its tenant's fair share: the tokens it was served (uncached prompt + completion).
        served = max(0, (prompt_tokens or 0) - cached_tokens) + completion_tokens
        self.queue.charge(rec.tenant, session, served)
        if prompt_chars is not None and prompt_tokens is not None:
            self.estimator.observe(session, prompt_chars, prompt_tokens)
        if prompt_tokens is not None:
            self.peaks.observe(session, prompt_tokens, completion_tokens)
        self.gauge.settle(session)  # the worker has seen its prompt now
        reprefill_s = None  # what rebuilding its context would take: the hold's floor
        if rec.worker is not None and prompt_tokens is not None:  # its blocks are free now
            s, context = self._signals[rec.worker], prompt_tokens + completion_tokens
            self.gauge.ended(session, rec.worker, rec.last_active, now,
                             blocks_for_tokens(context, s.block_size or DEFAULT_BLOCK_SIZE))
            reprefill_s = reprefill_seconds(context, s.prefill_tokens_per_s)
        rec = self.sessions.response_end(now, session, usual_tool_s, reprefill_s)
        if rec.final and rec.in_flight == 0:
            self._end(now, session, EndReason.FINAL, actions)
            self._admit_pass(now, actions)
        elif not rec.kv_held:  # a first call whose kind of session seldom returns
            self.peaks.release(session)
            if not rec.watched:  # its key's never do: as good as ended
                self.yields.away(session)
            # Its room is free now, slot kept or not (at the tick, a burst of one-shot tasks
            # went in once per tick while the engine idled between).
            self._admit_pass(now, actions)
        return actions

    def on_session_end(self, now: float, session: str, reason: EndReason) -> Actions:
        """The session ends (delete, or its waiting client left); its slot frees up."""
        actions = Actions()
        self.queue.remove(session)
        if self._end(now, session, reason, actions):
            self._admit_pass(now, actions)
        return actions

    # -- the control tick -----------------------------------------------------------------------
    def tick(self, now: float, signals_by_worker: Mapping[str, WorkerSignals]) -> Actions:
        """Control step: windows, idle timeouts, queue deadlines, admissions."""
        actions = Actions()
        for w in self.workers:
            # A worker the probes did not report on is unseen: fail closed.
            self._signals[w] = signals_by_worker.get(w, WorkerSignals(stale=True))
            self.gauge.read(w, self._signals[w].sampled_at)
            self.peaks.limit(w, self._signals[w].max_model_len)
            # The forecasts' sum once per worker: the controller's budget and the overlap.
            committed = (self.peaks.committed_tokens(w, self._signals[w].sessions_elsewhere)
                         if self.cfg.tuning.kv_fit_peak else 0)
            changes = self.controllers[w].tick(now, self._control_signals(w, committed))
            self._observe_overlap(now, w, committed)
            actions.window_changes.extend(changes)
            actions.events.extend(changes)
        for rec in self.sessions.idle_expired(now):
            self._end(now, rec.key, EndReason.IDLE_TIMEOUT, actions)
        self._holds_end(now)
        expired = self.queue.expire(now)
        if expired:
            placeable = any(v.placeable for v in self._views())
            reason = "queue_deadline" if placeable else "no_healthy_worker"
            retry = self.queue.retry_after(now)
            for e in expired:
                self.sessions.end(now, e.session, EndReason.QUEUE_DEADLINE)
                actions.expired.append(Expiry(e.session, 503, retry, reason))
                actions.events.append(Rejected(ts=now, session=e.session, reason=reason,
                                               status=503))
        self._admit_pass(now, actions)
        return actions

    def next_deadline(self) -> float | None:
        """When :meth:`expire` is due: a KV hold (or kept slot) ends while sessions wait."""
        return self.sessions.next_hold_end() if len(self.queue) else None

    def expire(self, now: float) -> Actions:
        """Holds due by ``now`` end: their room lets in who waits now, as a call's end does,
        not at the next tick (a burst came just before the last one's holds ended)."""
        actions = Actions()
        if self._holds_end(now):
            self._admit_pass(now, actions)
        return actions

    def _holds_end(self, now: float) -> bool:
        for rec in (due := self.sessions.hold_expired(now)):
            self.peaks.release(rec.key)
            self.yields.away(rec.key)
            self.overlaps.went_quiet(rec.key, rec.admitted_at, rec.last_active)
        return bool(due)

    def release_hold(self, session: str) -> bool:
        """A dormant session waits on its children: its forecast counts no more until its next
        request (False: it was not dormant within a hold)."""
        if not self.sessions.release_hold(session):
            return False
        self.peaks.release(session)
        return True

    def set_retained(self, worker: str, blocks: int) -> None:
        """The scheduler's KV ledger now, not at the next tick: no admission into its room."""
        s = self._signals[worker]
        if s.retained_blocks != blocks:
            self._signals[worker] = replace(s, retained_blocks=blocks)

    def _admit_pass(self, now: float, actions: Actions) -> None:
        if not len(self.queue):
            return
        views = self._views(now)
        taken = self.queue.select(now, views)
        self._took(now, taken, actions)
        if taken and len(self.queue) and self.capped(views):  # the fit alone may take more
            self._took(now, self.queue.select(now, self._views(now)), actions)

    def _took(self, now: float, taken: list[Admission], actions: Actions) -> None:
        """The sessions a pass admitted: counted on their workers, then announced."""
        for a in taken:
            self.sessions.admit(now, a.entry.session, a.worker)
            self.peaks.admit(a.entry.session, a.worker, a.entry.est_tokens, grows=a.entry.grows)
            self.yields.admitted(a.entry.session, a.entry.tenant, a.entry.cls)
            self._promise(a.entry.session, a.worker, a.entry.est_tokens)
        for a in taken:  # all of the pass counted: a move sees every slot it took
            a = self._by_prefix(a)
            rec = self.sessions.get(a.entry.session)
            queued_at = now if rec is None else rec.queued_at
            actions.admitted.append(a)
            actions.events.append(SessionAdmitted(ts=now, session=a.entry.session,
                                                  worker=a.worker, wait_s=now - queued_at))

    def _by_prefix(self, a: Admission) -> Admission:
        """Prefix placement (``aimd/prefix.py``) of a session the queue just admitted."""
        if a.forced or a.idle:
            self.prefixes.forget(a.entry.session)
            return a
        target = self.prefixes.admitted(a.entry.session, self._views, a.worker, a.entry.est_tokens)
        if target is None:
            return a
        self.move(a.entry.session, target, a.entry.est_tokens)
        return replace(a, worker=target)

    def _admit_unconditionally(
        self, now: float, session: str, tenant: str, est_tokens: int, final: bool,
        prefix: Mapping[str, int] | None, bound: str | None,
    ) -> Decision:
        # Admission off: the fewest sessions holding KV among healthy workers, ties to the
        # fewest placed, then worker order; no window (prefix placement ignores it too). Health
        # alone gates: a worker not read yet (just started) takes its share of a burst at once.
        names = [w for w in self.workers if self._signals[w].healthy]
        worker = min(names or self.workers, key=self.sessions.spread_key)
        if bound in names:
            worker, prefix = bound, None
        if prefix:
            views = [v for v in self._views() if v.name in names] or self._views()
            worker = prefer_prefix(self.placement, views, prefix, worker, est_tokens,
                                   counted=False, slots=False) or worker
        long = est_tokens > self.cfg.tuning.long_prompt_tokens
        self.sessions.queue(now, session, tenant, est_tokens, long, final)
        self.sessions.admit(now, session, worker)
        self.peaks.admit(session, worker, est_tokens, grows=self._grows(tenant))
        ev = SessionAdmitted(ts=now, session=session, worker=worker, wait_s=0.0)
        return Decision(DecisionKind.ADMITTED, worker=worker, reason="admission_disabled",
                        actions=Actions(events=[ev]))

    def _end(self, now: float, session: str, reason: EndReason, actions: Actions) -> bool:
        rec = self.sessions.end(now, session, reason)
        self._bound.pop(session, None)
        self.gauge.settle(session)
        self.queue.forget(session)
        self.prefixes.forget(session)
        self.peaks.end(session, finished=reason in RAN_ITS_COURSE)
        self.yields.ended(session)
        if rec is not None and rec.admitted_at is not None and reason in RAN_ITS_COURSE:
            self.overlaps.session_lived(now - rec.admitted_at)
        self.estimator.forget(session)
        if rec is None:
            return False
        actions.ended.append((session, reason))
        actions.events.append(SessionEnd(
            ts=now, session=session, worker=rec.worker, reason=str(reason), turns=rec.turns,
            duration_s=now - rec.queued_at))
        return True
