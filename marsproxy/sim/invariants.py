"""Invariants of the admission plane, checked on a simulated run (``marsproxy sim --sweep``).

- (a) work conservation: after a control tick, no session waits while some worker could take
  its first prompt without overload (placeable, neither KV nor tool CPU overloaded, below its
  limit, the prompt within its KV budget);
- (b) every session finishes or is refused with a documented reason, and no waiting session is
  bypassed more than ``admission.tuning.max_bypass`` times;
- (c) at light load (``direct`` sees no preemption and no tool waits for a core) the mean and
  the P95 end-to-end latency of the proxy stay within ``tolerance`` of ``direct``'s;
- (d) at the end nothing is held: no session, queue entry or block promise in the admission
  core, no reservation, queued or running call in the scheduler core, no waiting agent, no call
  in an engine, no tool phase.

Pure functions of the cores' and the run's state: they report, they change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from marsproxy.aimd.admission import AdmissionCore
from marsproxy.aimd.queue import WorkerView
from marsproxy.core.kv import blocks_for_tokens, fits
from marsproxy.runs.results import RunResult, percentile
from marsproxy.sched.core import SchedulerCore

# The reasons docs/admission.md lists for a session the proxy refuses, with their statuses.
DOCUMENTED_REFUSALS: dict[str, int] = {
    "queue_full": 429, "queue_deadline": 503, "no_healthy_worker": 503,
}


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str  # "a", "b", "c" or "d"
    at_s: float | None
    what: str

    def __str__(self) -> str:
        at = "" if self.at_s is None else f" t={self.at_s:.2f}s"
        return f"({self.rule}){at} {self.what}"


def open_to(view: WorkerView) -> bool:
    """Whether ``view``'s worker takes new sessions without overload: placeable, not
    overloaded, below its limit."""
    return (view.placeable and not view.kv_overloaded and not view.cpu_overloaded
            and view.admitted < view.limit)


def check_tick(now: float, core: AdmissionCore) -> list[Violation]:
    """(a) and (b)'s bypass bound, from the core's state right after its control tick."""
    if not len(core.queue):
        return []
    out: list[Violation] = []
    views = [v for v in core.views(now) if open_to(v)]
    bound = core.cfg.tuning.max_bypass
    for pos, e in enumerate(core.queue.ordered(now)):
        bypassed = core.queue.bypasses(e.session)
        if bypassed > bound:
            out.append(Violation("b", now, f"session {e.session} bypassed {bypassed} times"
                                 f" (max_bypass {bound})"))
        for v in views:
            blocks = blocks_for_tokens(e.est_tokens, v.block_size)
            if fits(blocks, v.budget_blocks):
                out.append(Violation("a", now, (
                    f"session {e.session} (queue position {pos}, {e.est_tokens} tokens ="
                    f" {blocks} blocks{', long' if e.long else ''}) waits while {v.name} has"
                    f" room: admitted {v.admitted} < limit {v.limit}, budget"
                    f" {v.budget_blocks} blocks (free {v.free_budget_blocks}, peak room"
                    f" {v.peak_room_blocks}), long admitted {v.long_admitted}")))
                break
    return out


def check_outcomes(result: RunResult) -> list[Violation]:
    """(b): each session finished every turn, or the proxy refused it for a documented reason
    with its status."""
    out = []
    for o in result.outcomes:
        if o.ok:
            continue
        status = o.turns[-1].status if o.turns else None
        if DOCUMENTED_REFUSALS.get(o.error) == status:
            continue
        out.append(Violation("b", o.end_s, (
            f"session {o.id} ({result.policy}) neither finished nor was refused for a documented"
            f" reason: {len(o.turns)}/{o.planned_turns} turns, last status {status},"
            f" error {o.error or 'none'!r}")))
    return out


def check_drained(
    core: AdmissionCore | None, sched: SchedulerCore | None, leftovers: dict[str, int],
    end_s: float | None = None,
) -> list[Violation]:
    """(d): at the end of a run nothing is held anywhere."""
    out: list[Violation] = []

    def held(what: str, n: int) -> None:
        if n:
            out.append(Violation("d", end_s, f"{what}: {n} left at the end"))

    if core is not None:
        held("admission queue entries", len(core.queue))
        held("sessions in the admission core", len(core.sessions))
        held("sessions admitted on workers", sum(core.sessions.admitted_on(w)
                                                 for w in core.workers))
        promised, blocks = core.promised()
        held("pending block promises", promised)
        held("promised blocks", blocks)
    if sched is not None:
        held("scheduler reserved blocks", sum(sched.retained_blocks(w) for w in sched.workers))
        held("scheduler gated calls", sum(sched.queue_length(w) for w in sched.workers))
        held("scheduler calls in flight", sum(sched.in_flight(w) for w in sched.workers))
    for what, n in leftovers.items():
        held(what.replace("_", " "), n)
    return out


@dataclass(frozen=True, slots=True)
class LightLoad:
    mean_ratio: float
    p95_ratio: float
    unfinished: int = 0
    """Sessions ``direct`` finished and the proxy did not."""

    @property
    def worst(self) -> float:
        return max(self.mean_ratio, self.p95_ratio)


def light_load(direct: RunResult, proxied: RunResult) -> LightLoad | None:
    """The proxy's mean and P95 end-to-end latency over ``direct``'s, on the sessions both
    finished (``None``: none)."""
    mine = {o.id: o.e2e_s for o in proxied.outcomes if o.e2e_s is not None}
    pairs = [(mine[o.id], o.e2e_s) for o in direct.outcomes
             if o.e2e_s is not None and o.id in mine]
    if not pairs:
        return None
    unfinished = sum(1 for o in direct.outcomes if o.e2e_s is not None and o.id not in mine)
    a, b = [p for p, _ in pairs], [d for _, d in pairs]
    return LightLoad(sum(a) / sum(b), percentile(a, 95) / percentile(b, 95), unfinished)


def light_load_violations(r: LightLoad | None, policy: str, tolerance: float) -> list[Violation]:
    """(c) on a light-load workload, from the comparison :func:`light_load` made: every session
    ``direct`` finished, the proxy finished too, within ``tolerance`` in mean and P95."""
    if r is None or (r.worst <= 1.0 + tolerance and not r.unfinished):
        return []
    return [Violation("c", None, (
        f"{policy} at light load: mean E2E {r.mean_ratio:.4f}x, P95"
        f" {r.p95_ratio:.4f}x direct (bound {1 + tolerance:.2f}x), {r.unfinished} sessions"
        " direct finished did not finish"))]
