"""What a benchmark run produces, and the figures computed from it (shared by live and sim).

Times are seconds from the start of the run (the first planned arrival is at 0): wall seconds
for the live benchmark, modelled seconds for the simulator.

Every figure covers every session of the workload, so that policies are compared on the same
sessions. Definitions (docs/methodology.md repeats them):
- a session *finished* when every planned call got a full 200 answer; it was *refused* when a
  call got a 429 or 503 from the proxy (a full queue, the queue deadline; the replay stops
  there, as an agent that gives up would); it *failed* otherwise (an upstream error, a client
  timeout, still running at the simulator's horizon);
- completion: finished sessions / sessions;
- end-to-end latency of a session (``counted_s``): from its planned arrival to the end of its
  last response, including admission waits and tool phases; for a session that did not
  finish, from its arrival to when it stopped (the refusal, the failed call, the horizon): a
  lower bound of the time it would have taken. Mean, P50, P90 and P95 are over every session,
  so with a completion below 100 % they are lower bounds too (the report marks them ``≥``);
  ``mean_finished_s`` is the mean over finished sessions alone, for reference;
- goodput: sessions per second that finished within ``goodput_factor`` (3) × their ideal time
  (:mod:`marsproxy.runs.ideal`), over the makespan (first arrival to the last session's end
  or stop); a session that did not finish never counts;
- throughput: finished sessions per second over the same makespan;
- warm resume: a continuation (turn ≥ 2) whose cached prefix covers at least 90 % of the
  previous call's prompt, i.e. the session's KV survived its tool phase.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GOODPUT_FACTOR = 3.0
WARM_FRACTION = 0.9


def slug(*parts: str) -> str:
    """A file-name part made of a run's labels (regime, load, policy)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(p for p in parts if p)).strip("_") or "run"


def write_log(logs: Path, kind: str, label: str, policy: str, rows: Sequence[Any]) -> None:
    """``logs/<kind>-<label>-<policy>.jsonl``, one JSON row per line (nothing when no rows): a
    run's event stream or state snapshots, live or simulated, under one name."""
    if rows:
        with open(logs / f"{kind}-{slug(label, policy)}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


@dataclass(slots=True)
class TurnOutcome:
    sent_s: float
    ttft_s: float | None
    latency_s: float
    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass(slots=True)
class SessionOutcome:
    id: str
    arrival_s: float
    ideal_s: float
    planned_turns: int
    end_s: float | None = None
    """When its last call ended, for a finished session."""
    turns: list[TurnOutcome] = field(default_factory=list)
    error: str = ""
    stopped_s: float | None = None
    """When a session that did not finish stopped: its refusal, its failed call, or the time
    the run gave it up (the simulator's horizon)."""
    tree: str = ""
    """Agent trees: the id of its tree's root (itself for a root), "" outside any tree."""
    group: str = ""
    """Mixed workloads (``runs/mix.py``): its group, "" outside any."""

    @property
    def ok(self) -> bool:
        return (self.end_s is not None and len(self.turns) == self.planned_turns
                and all(t.status == 200 for t in self.turns))

    @property
    def e2e_s(self) -> float | None:
        return None if not self.ok or self.end_s is None else self.end_s - self.arrival_s

    @property
    def rejected(self) -> bool:
        """Refused by the proxy (429 or 503)."""
        return any(t.status in (429, 503) for t in self.turns)

    @property
    def status(self) -> str:
        """``finished``, ``refused`` or ``failed``."""
        return "finished" if self.ok else "refused" if self.rejected else "failed"

    @property
    def counted_s(self) -> float:
        """Its end-to-end latency as the figures count it: arrival to the end of its last call
        when it finished, else arrival to when it stopped (a lower bound of its real time)."""
        if self.ok and self.end_s is not None:
            return self.end_s - self.arrival_s
        stop = self.stopped_s
        if stop is None:  # a result built without a stop time: the end of its last call
            stop = max((t.sent_s + t.latency_s for t in self.turns), default=self.arrival_s)
        return max(0.0, stop - self.arrival_s)

    @property
    def last_s(self) -> float | None:
        """When the session ended or stopped (None: never started a call)."""
        if self.ok and self.end_s is not None:
            return self.end_s
        if self.stopped_s is not None or self.turns:
            return self.arrival_s + self.counted_s
        return None

    def warm_resumes(self) -> tuple[int, int]:
        """(warm continuations, continuations)."""
        warm = total = 0
        for prev, cur in zip(self.turns, self.turns[1:], strict=False):
            if cur.status != 200 or prev.prompt_tokens <= 0:
                continue
            total += 1
            warm += cur.cached_tokens >= WARM_FRACTION * prev.prompt_tokens
        return warm, total


def load_label(load: str, seed: int | None) -> str:
    """One workload's name: its load, and its seed when a run covers several (``--seeds``)."""
    return load if seed is None else f"{load}, seed {seed}"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass(frozen=True, slots=True)
class Summary:
    """A run's figures (see the module docstring): latencies over every session."""

    sessions: int
    finished: int
    rejected: int
    failed: int
    completion: float
    """finished / sessions (NaN without sessions)."""
    mean_s: float
    p50_s: float
    p90_s: float
    p95_s: float
    goodput_per_s: float
    within_slo: int
    throughput_per_s: float
    makespan_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    warm_resume_rate: float
    slowdown_mean: float
    """Mean of counted e2e / ideal over every session."""
    mean_finished_s: float
    """Mean e2e over finished sessions alone (not comparable across policies that finish
    different sessions)."""
    trees: int = 0
    """Agent trees in the workload (roots that spawned children)."""
    tree_mean_s: float = math.nan
    """Tree completion time: mean over roots of their counted e2e (children's runs in it)."""
    tree_completion: float = math.nan
    """Trees whose every session finished / trees."""

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def summarize(outcomes: Sequence[SessionOutcome], factor: float = GOODPUT_FACTOR) -> Summary:
    done = [o for o in outcomes if o.ok]
    counted = [o.counted_s for o in outcomes]
    ends = [t for t in (o.last_s for o in outcomes) if t is not None]
    start = min((o.arrival_s for o in outcomes), default=0.0)
    makespan = (max(ends) - start) if ends else 0.0
    within = sum(1 for o in done if o.e2e_s is not None and o.e2e_s <= factor * o.ideal_s)
    ttfts = [t.ttft_s for o in outcomes for t in o.turns
             if t.status == 200 and t.ttft_s is not None]
    warm = total = 0
    for o in outcomes:
        w, n = o.warm_resumes()
        warm += w
        total += n
    rejected = sum(1 for o in outcomes if o.rejected and not o.ok)

    def rate(n: int) -> float:
        return n / makespan if makespan > 0 else math.nan

    return Summary(
        sessions=len(outcomes),
        finished=len(done),
        rejected=rejected,
        failed=len(outcomes) - len(done) - rejected,
        completion=len(done) / len(outcomes) if outcomes else math.nan,
        mean_s=_mean(counted),
        p50_s=percentile(counted, 50),
        p90_s=percentile(counted, 90),
        p95_s=percentile(counted, 95),
        goodput_per_s=rate(within),
        within_slo=within,
        throughput_per_s=rate(len(done)),
        makespan_s=makespan,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        warm_resume_rate=warm / total if total else math.nan,
        slowdown_mean=_mean([o.counted_s / o.ideal_s for o in outcomes if o.ideal_s > 0]),
        mean_finished_s=_mean([o.e2e_s for o in done if o.e2e_s is not None]),
        **_trees(outcomes),
    )


def _trees(outcomes: Sequence[SessionOutcome]) -> dict[str, Any]:
    members: dict[str, list[SessionOutcome]] = {}
    for o in outcomes:
        if o.tree:
            members.setdefault(o.tree, []).append(o)
    roots = [o for o in outcomes if o.tree and o.tree == o.id]
    done = sum(all(m.ok for m in members[r.id]) for r in roots)
    return {"trees": len(roots), "tree_mean_s": _mean([r.counted_s for r in roots]),
            "tree_completion": done / len(roots) if roots else math.nan}


def group_summaries(outcomes: Sequence[SessionOutcome]) -> dict[str, Summary]:
    """Mixed workloads: the figures of each group's sessions (in order of first
    appearance); none unmixed."""
    by: dict[str, list[SessionOutcome]] = {}
    for o in outcomes:
        if o.group:
            by.setdefault(o.group, []).append(o)
    return {g: summarize(os) for g, os in by.items()}


@dataclass(slots=True)
class RunResult:
    """One policy on one workload (a regime at a load, from one seed)."""

    policy: str
    regime: str
    load: str
    outcomes: list[SessionOutcome]
    timeline: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    """The workload's seed when the run covers several (``--seeds``), else ``None``."""

    @property
    def case_load(self) -> str:
        return load_label(self.load, self.seed)

    def summary(self) -> Summary:
        return summarize(self.outcomes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "regime": self.regime, "load": self.load, "seed": self.seed,
            "summary": self.summary().to_dict(),
            "groups": {g: s.to_dict() for g, s in group_summaries(self.outcomes).items()},
            "sessions": [
                {**asdict(o), "ok": o.ok, "status": o.status, "refused": o.rejected,
                 "e2e_s": o.e2e_s, "counted_s": o.counted_s} for o in self.outcomes
            ],
            "timeline": {k: [list(p) for p in v] for k, v in self.timeline.items()},
            "extra": self.extra,
        }
