"""Benchmark workloads: sessions from traces, scaled, capped, given arrival times. Deterministic.

A :class:`WorkloadSpec` says how to turn a trace file into the sessions one benchmark run replays:

- ``sessions``: how many; sampled with a seeded RNG (without replacement while the trace has
  enough, then with replacement; repeats get their own ids);
- ``regime_peak_tokens``: an input-length regime (the paper's ILR-1..4): every session's prompts
  are scaled, first prompt and growth alike, so that the workload's *median* peak context is this
  many tokens; a session whose peak would pass ``max_context_tokens`` is scaled less;
- ``token_scale`` multiplies every token count afterwards (inputs and outputs), ``tool_time_scale``
  every tool time; ``max_turns`` caps the LLM calls per session;
- arrivals (:mod:`marsproxy.runs.arrivals`): Poisson, fixed rate or bursts;
- ``mix``: groups of sessions of their own service class or tenant, each with its own count
  and arrival rate (:mod:`marsproxy.runs.mix`), in place of ``sessions`` and the one rate;
- ``prefix_groups``: sessions in that many groups (each drawn at random, seeded, so that no
  group lines up with a round robin over workers) whose first prompts share ``prefix_tokens``
  tokens (one repository's context, a long task description): every prompt of a session grows
  by them, after the common system prompt and before the session's own tokens (what prefix
  placement is for; docs/kv-events.md).

The same spec and trace give the same workload, bit for bit (tested).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from marsproxy.runs.arrivals import ArrivalSpec, arrival_times
from marsproxy.runs.mix import MixGroup
from marsproxy.runs.trace import SessionTrace
from marsproxy.runs.trees import grow_trees

# Regimes named as in the docs: median peak context of the workload, in tokens.
REGIMES: dict[str, int] = {"8k": 8_192, "32k": 32_768, "64k": 65_536, "128k": 131_072}


@dataclass(frozen=True, slots=True)
class PlannedTurn:
    """One LLM call and the tool phase after it (``tool_s`` None after the last call)."""

    input_tokens: int
    output_tokens: int
    tool_s: float | None
    tool: str


@dataclass(frozen=True, slots=True)
class PlannedSession:
    id: str
    trace_id: str
    arrival_s: float
    turns: tuple[PlannedTurn, ...]
    group: int | None = None
    """The shared first-prompt group (``WorkloadSpec.prefix_groups``); None: none."""
    shared_tokens: int = 0
    """Tokens of the group's shared prefix at the start of every prompt."""
    parent: str | None = None
    """Agent trees (``runs/trees.py``): the session that spawns this one (it has no arrival
    of its own: it starts when its parent's tool phase does)."""
    children: tuple[str, ...] = ()
    spawn_at: int = -1
    """The turn whose tool phase is the children's run (the parent waits on all of them)."""
    mix: str = ""
    """Mixed workloads: the session's group ("": none)."""
    tenant: str = ""
    """The tenant it sends as ("": the run's one tenant)."""
    cls: str | None = None
    """The service class it asks for (``None``: the default)."""

    @property
    def peak_tokens(self) -> int:
        return max(t.input_tokens for t in self.turns)

    @property
    def tool_s_total(self) -> float:
        return sum(t.tool_s or 0.0 for t in self.turns)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    sessions: int = 16
    seed: int = 0
    regime_peak_tokens: int | None = None
    max_context_tokens: int = 250_000
    token_scale: float = 1.0
    tool_time_scale: float = 1.0
    max_turns: int | None = None
    min_input_tokens: int = 16
    arrivals: ArrivalSpec = field(default_factory=ArrivalSpec)
    prefix_groups: int = 0
    prefix_tokens: int = 4096
    trees: tuple[int, int] | None = None
    """Agent trees: each root spawns between these many children (``runs/trees.py``)."""
    mix: tuple[MixGroup, ...] = ()
    """Groups of their own class or tenant, count and rate (``runs/mix.py``); replaces
    ``sessions`` and ``arrivals.rate_per_s``."""

    def __post_init__(self) -> None:
        if self.sessions < 1:
            raise ValueError("sessions must be >= 1")
        if self.token_scale <= 0 or self.tool_time_scale < 0:
            raise ValueError("token_scale must be > 0 and tool_time_scale >= 0")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        if self.regime_peak_tokens is not None and self.regime_peak_tokens < 1:
            raise ValueError("regime_peak_tokens must be >= 1")
        if self.prefix_groups < 0 or self.prefix_tokens < 1:
            raise ValueError("prefix_groups must be >= 0 and prefix_tokens >= 1")
        if self.prefix_groups and self.prefix_tokens >= self.max_context_tokens:
            raise ValueError("prefix_tokens must be below max_context_tokens")


@dataclass(frozen=True, slots=True)
class Workload:
    spec: WorkloadSpec
    sessions: tuple[PlannedSession, ...]

    def describe(self) -> dict[str, float]:
        peaks = [s.peak_tokens for s in self.sessions]
        turns = [len(s.turns) for s in self.sessions]
        return {
            "sessions": len(self.sessions),
            "turns_total": sum(turns),
            "turns_p50": statistics.median(turns),
            "first_prompt_p50": statistics.median(s.turns[0].input_tokens for s in self.sessions),
            "peak_p50": statistics.median(peaks),
            "peak_max": max(peaks),
            "tool_s_total": sum(s.tool_s_total for s in self.sessions),
            "last_arrival_s": max(s.arrival_s for s in self.sessions),
        }


def pick(traces: Sequence[SessionTrace], n: int, rng: random.Random) -> list[SessionTrace]:
    """``n`` traces: a seeded sample without replacement, then with replacement past the file."""
    if not traces:
        raise ValueError("no traces to pick from")
    k = min(n, len(traces))
    out = rng.sample(list(traces), k=k)
    out.extend(rng.choice(traces) for _ in range(n - k))
    return out


def _cap_turns(trace: SessionTrace, max_turns: int | None) -> SessionTrace:
    if max_turns is None or len(trace.turns) <= max_turns:
        return trace
    return SessionTrace(trace.id, trace.turns[:max_turns])


def _input_scale(trace: SessionTrace, spec: WorkloadSpec, median_peak: float) -> float:
    scale = spec.token_scale
    if spec.regime_peak_tokens is not None:
        scale *= spec.regime_peak_tokens / median_peak
    peak = max(t.input_tokens for t in trace.turns)
    room = spec.max_context_tokens - (spec.prefix_tokens if spec.prefix_groups else 0)
    # No prompt may pass the context limit; this session grows less than the others.
    return min(scale, room / max(1, peak))


def _plan(trace: SessionTrace, sid: str, arrival: float, spec: WorkloadSpec,
          in_scale: float, group: int | None = None) -> PlannedSession:
    shared = 0 if group is None else spec.prefix_tokens
    turns: list[PlannedTurn] = []
    last = len(trace.turns) - 1
    prev = 0
    for i, t in enumerate(trace.turns):
        # Prompts are append-only: never shorter than the previous one (traces have a few
        # negative steps where the harness compacted its context).
        tokens = max(spec.min_input_tokens, round(t.input_tokens * in_scale), prev + 1)
        prev = tokens
        tool = None if i == last or t.tool_s is None else t.tool_s * spec.tool_time_scale
        turns.append(PlannedTurn(
            input_tokens=tokens + shared,
            output_tokens=max(1, round(t.output_tokens * spec.token_scale)),
            tool_s=tool,
            tool=t.tool,
        ))
    return PlannedSession(sid, trace.id, arrival, tuple(turns), group, shared)


def build_workload(traces: Sequence[SessionTrace], spec: WorkloadSpec) -> Workload:
    """The sessions of one run: same ``traces`` and ``spec`` → the same workload."""
    if not spec.mix:
        return Workload(spec, tuple(_sessions(traces, spec, "")))
    sessions = []
    for g in spec.mix:
        # Each group on its own (its seeds salted by its name): alone, the same sessions.
        own = dataclasses.replace(spec, sessions=g.sessions, mix=(), arrivals=dataclasses.replace(
            spec.arrivals, rate_per_s=g.rate_per_s))
        sessions += [dataclasses.replace(
            s, id=f"{g.name}/{s.id}", mix=g.name, tenant=g.tenant, cls=g.cls,
            parent=None if s.parent is None else f"{g.name}/{s.parent}",
            children=tuple(f"{g.name}/{c}" for c in s.children),
        ) for s in _sessions(traces, own, f":{g.name}")]
    sessions.sort(key=lambda s: s.arrival_s)
    return Workload(spec, tuple(sessions))


def _sessions(traces: Sequence[SessionTrace], spec: WorkloadSpec,
              salt: str) -> list[PlannedSession]:
    rng = random.Random(f"workload:{spec.seed}{salt}")
    chosen = [_cap_turns(t, spec.max_turns) for t in pick(traces, spec.sessions, rng)]
    median_peak = statistics.median(max(t.input_tokens for t in tr.turns) for tr in chosen)
    times = arrival_times(spec.arrivals, len(chosen),
                          random.Random(f"arrivals:{spec.seed}{salt}"))
    seen: dict[str, int] = {}
    sessions = []
    groups = random.Random(f"groups:{spec.seed}{salt}")
    for tr, at in zip(chosen, times, strict=True):
        n = seen.get(tr.id, 0)
        seen[tr.id] = n + 1
        sid = tr.id if n == 0 else f"{tr.id}~{n}"
        group = groups.randrange(spec.prefix_groups) if spec.prefix_groups else None
        sessions.append(_plan(tr, sid, at, spec, _input_scale(tr, spec, median_peak), group))
    if spec.trees is not None:
        sessions = grow_trees(sessions, spec.trees,
                              random.Random(f"trees:{spec.seed}{salt}"))
    return sessions
