"""The ONE place where the simulator asks the scheduler for decisions.

Every scheduling decision of a simulated policy goes through :class:`SchedulerAdapter`: the
priority of a continuation, the KV retention decision at the end of a call, the KV ledger's
reservations (which the admission budget subtracts). Today it composes the pure pieces of
``marsproxy/sched/`` (``priority.level``, ``retention.decide``, ``KvLedger``, ``SessionService``);
when the gateway's pure scheduler core lands, this module is the one to switch to it, and the
harness stays as it is.

Policy meaning (``scheduler.priority_policy``):
- ``mars``: level from the uncached prefill bucket, demoted by attained service (§5.3); a
  continuation whose prefix is reserved in the ledger counts only its new tokens;
- ``las``: least attained service only (Autellix);
- ``session_fcfs``: sessions in arrival order (Continuum); the engine priority is the session's
  arrival number, so older programs go first;
- ``off``: no priority (the engine runs FCFS).
Levels reach the engine as vLLM's body ``priority`` (workers run ``--scheduling-policy
priority``); the continuation has not waited when it is dispatched, so aging does not apply.

Pure code: no I/O; ``now`` is a parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from marsproxy.core.events import Event
from marsproxy.sched.config import SchedulerConfig
from marsproxy.sched.ledger import KvLedger
from marsproxy.sched.priority import SessionService, level, service_of
from marsproxy.sched.retention import decide

_PREFILL_EMA_ALPHA = 0.2


@dataclass(frozen=True, slots=True)
class CallDone:
    """What the adapter learns when a call of ``session`` on ``worker`` ends."""

    session: str
    worker: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prefill_s: float
    engine_s: float


class SchedulerAdapter:
    def __init__(self, cfg: SchedulerConfig, block_size: int) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.ledger = KvLedger()
        self.service = SessionService()
        self._prefill_tps: dict[str, float] = {}  # worker → EMA of measured prefill tokens/s
        self._last_level: dict[str, int] = {}

    @property
    def engine_priority(self) -> bool:
        """Whether workers must schedule by the body ``priority`` for this policy."""
        return self.cfg.priority_policy != "off"

    # -- decisions --------------------------------------------------------------------------
    def dispatch_priority(
        self, now: float, session: str, session_seq: int, prompt_tokens: int,
        context_tokens: int,
    ) -> int:
        """The engine priority of a call of ``prompt_tokens`` whose session had
        ``context_tokens`` in KV after its previous call (0 for a first call)."""
        policy = self.cfg.priority_policy
        if policy == "off":
            return 0
        if policy == "session_fcfs":
            return session_seq
        attained = self.service.attained(session)
        if policy == "las":
            lv = level(0, attained, 0.0, self.cfg)
        else:
            warm = self.ledger.reservation(session) is not None
            uncached = prompt_tokens - context_tokens if warm else prompt_tokens
            lv = level(uncached, attained, 0.0, self.cfg)
        self._last_level[session] = lv
        return lv

    def on_return(self, session: str) -> None:
        """The session's next call arrived: its prefix is in use again."""
        self.ledger.release_on_return(session)

    def on_call_done(
        self, now: float, done: CallDone, predicted_tool_s: float | None, final: bool
    ) -> list[Event]:
        """Service and prefill throughput bookkeeping, then the retention decision."""
        self.service.add(session=done.session, amount=service_of(
            self.cfg, done.prompt_tokens, done.completion_tokens, done.engine_s))
        uncached = done.prompt_tokens - done.cached_tokens
        if uncached > 0 and done.prefill_s > 0:
            tps = uncached / done.prefill_s
            old = self._prefill_tps.get(done.worker)
            self._prefill_tps[done.worker] = (
                tps if old is None else _PREFILL_EMA_ALPHA * tps + (1 - _PREFILL_EMA_ALPHA) * old
            )
        if final:
            return []
        context = done.prompt_tokens + done.completion_tokens
        out = decide(context, self._prefill_tps.get(done.worker), predicted_tool_s, self.cfg,
                     self.block_size)
        if out.retain and out.ttl_s > 0:
            self.ledger.reserve(done.session, done.worker, out.blocks, now, out.ttl_s,
                                self._last_level.get(done.session, 0))
        return [out.to_event(now, done.session, done.worker)]

    def retained_blocks(self, worker: str) -> int:
        return self.ledger.reserved_blocks(worker)

    def maintain(self, now: float, worker: str, budget_blocks: int | None) -> None:
        """Each control tick: expire reservations; under KV pressure (a negative budget) drop
        dormant reservations before running work is held back."""
        self.ledger.expire(now)
        if budget_blocks is not None and budget_blocks < 0:
            self.ledger.drop_under_pressure(worker, -budget_blocks)

    def forget(self, session: str) -> None:
        self.ledger.release_on_return(session)
        self.service.forget(session)
        self._last_level.pop(session, None)
