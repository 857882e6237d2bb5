"""What a demo run records (worker peaks, timeline columns, every session's result and the
proxy's events) and the summary printed from it: sessions, admission decisions, the timeline."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from marsproxy.bench.agent import (
    SessionResult,
)
from marsproxy.core.events import Event, SessionAdmitted, SessionQueued, WindowChange


@dataclass
class WorkerSample:
    kv_peak: float = 0.0
    running_peak: float = 0.0
    waiting_peak: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)


@dataclass
class Tick:
    """One timeline column: per worker, per replica; ``calm`` once the calm phase began."""

    calm: bool
    window: dict[str, int]
    limit: dict[str, int | None]  # None: no count bound
    admitted: dict[str, list[int]]  # worker → admitted per replica
    store: dict[str, int]  # worker → live leases in the store (all replicas)
    kv: dict[str, float | None]
    waiting: list[int]  # per replica: queued + pending
    backlog: float


@dataclass
class RunResult:
    label: str
    results: list[SessionResult]
    samples: list[WorkerSample]
    urls: list[str]
    wall: float
    events: list[Event]
    timeline: list[Tick]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _admission_lines(events: list[Event]) -> list[str]:
    """What the admission window did: sessions held back, and how the window moved."""
    queued = sum(isinstance(e, SessionQueued) for e in events)
    waits = [e.wait_s for e in events if isinstance(e, SessionAdmitted)]
    changes = [e for e in events if isinstance(e, WindowChange)]
    held = [w for w in waits if w > 0.05]
    lines = [
        f"admission: {len(waits)} sessions admitted, {queued} queued first; {len(held)} waited"
        + (f" (wait mean {1000 * statistics.mean(held):.0f} ms, max {1000 * max(held):.0f} ms)"
           if held else "")
    ]
    by_worker: dict[str, list[WindowChange]] = {}
    for c in changes:
        by_worker.setdefault(c.worker or "?", []).append(c)
    for worker, cs in sorted(by_worker.items()):
        reasons: dict[str, int] = {}
        for c in cs:
            reasons[c.reason] = reasons.get(c.reason, 0) + 1
        low = min(min(c.new, c.old) for c in cs)
        told = ", ".join(f"{r} x{n}" for r, n in sorted(reasons.items()))
        lines.append(
            f"  window {worker}: {cs[0].old:.0f} -> {cs[-1].new:.0f}, lowest {low:.0f}"
            f" ({len(cs)} changes: {told})"
        )
    return lines


def _bound(limit: int | None) -> str:
    return "-" if limit is None else str(limit)


def _top(ticks: list[Tick], worker: str) -> int | None:
    """The highest count bound a worker had (None: never bounded)."""
    bounds = [b for b in (t.limit[worker] for t in ticks) if b is not None]
    return max(bounds) if bounds else None


def _row(name: str, ticks: list[Tick], cell: Any) -> str:
    cells = []
    for i, t in enumerate(ticks):
        sep = "|" if i and t.calm and not ticks[i - 1].calm else " "
        cells.append(f"{sep}{cell(t):>3}")
    return f"  {name:<16}" + "".join(cells)


def _timeline_lines(run: RunResult, period_s: float, replicas: int) -> list[str]:
    ticks = run.timeline
    if not ticks or not ticks[0].window:
        return []
    stride = max(1, -(-len(ticks) // 30))  # at most 30 columns
    shown = ticks[::stride]
    lines = [f"timeline [{run.label}]: one column per {period_s * stride:g} s; '|' marks the"
             " start of the calm phase; a limit '-' is no count bound (no overload)"]
    for w in shown[0].window:
        lines.append(_row(f"{w} window", shown, lambda t, w=w: t.window[w]))
        lines.append(_row(f"{w} limit", shown, lambda t, w=w: _bound(t.limit[w])))
        lines.append(_row(f"{w} KV %", shown, lambda t, w=w: (
            "?" if t.kv[w] is None else round(100 * (t.kv[w] or 0.0)))))
        if replicas > 1:
            for r in range(replicas):
                lines.append(_row(f"{w} admitted r{r}", shown,
                                  lambda t, w=w, r=r: t.admitted[w][r]))
            lines.append(_row(f"{w} shared total", shown, lambda t, w=w: t.store[w]))
        else:
            lines.append(_row(f"{w} admitted", shown, lambda t, w=w: t.admitted[w][0]))
    lines.append(_row("waiting", shown, lambda t: sum(t.waiting)))
    lines.append(_row("tool backlog x10", shown, lambda t: round(10 * t.backlog)))
    if replicas > 1:
        peaks = ", ".join(
            f"{w}: {max(t.store[w] for t in ticks)} (limit at most {_bound(_top(ticks, w))})"
            for w in ticks[0].window
        )
        lines.append(f"  one window for {replicas} replicas: live leases of all replicas together"
                     f" peaked at {peaks}; 'admitted rN' counts sessions still waiting for the"
                     " store's confirmation too")
    return lines


def _run_lines(run: RunResult) -> list[str]:
    turns = [t for r in run.results for t in r.turns]
    ok_turns = [t for t in turns if t.ok]
    e2e = [r.ended - r.started for r in run.results]
    pre = sum(s.counters.get("vllm:num_preemptions_total", 0.0) for s in run.samples)
    queries = sum(s.counters.get("vllm:prefix_cache_queries_total", 0.0) for s in run.samples)
    hits = sum(s.counters.get("vllm:prefix_cache_hits_total", 0.0) for s in run.samples)
    return [
        f"{run.label:<18} sessions {sum(r.ok for r in run.results)}/{len(run.results)}"
        f"  calls {len(ok_turns)} ok/{len(turns) - len(ok_turns)} failed"
        f"  e2e mean {statistics.mean(e2e):.2f} s p95 {_pct(e2e, 0.95):.2f} s"
        f"  KV peak {100 * max(s.kv_peak for s in run.samples):.0f}%"
        f"  preemptions {pre:.0f}"
        f"  prefix-cache hits {100 * hits / queries if queries else 0:.0f}%"
        f"  wall {run.wall:.1f} s"
    ]


def summary(runs: list[RunResult], sample_s: float, replicas: int) -> str:
    """The demo's closing report; ``sample_s`` and ``replicas`` shape its timeline."""
    main = runs[-1]
    turns = [t for r in main.results for t in r.turns]
    ok_turns = [t for t in turns if t.ok]
    lines = ["", "marsproxy demo — summary", ""]
    lines.append(f"{'session':<34}{'turns':>6}{'prompt tok':>12}{'cached %':>10}{'e2e s':>9}  ok")
    for r in main.results:
        prompt = sum(t.prompt_tokens for t in r.turns)
        cached = sum(t.cached_tokens for t in r.turns)
        pct = 100.0 * cached / prompt if prompt else 0.0
        lines.append(
            f"{r.session_id:<34}{len(r.turns):>6}{prompt:>12}{pct:>9.1f}%"
            f"{r.ended - r.started:>9.2f}  {'yes' if r.ok else 'NO'}"
        )
    ttfts = [t.ttft_s for t in ok_turns if t.ttft_s is not None]
    overheads = [t.overhead_ms for t in ok_turns if t.overhead_ms is not None]
    lines.append("")
    lines.append(
        f"sessions finished: {sum(r.ok for r in main.results)}/{len(main.results)}   "
        f"LLM calls: {len(ok_turns)} ok, {len(turns) - len(ok_turns)} failed   "
        f"wall: {main.wall:.1f} s"
    )
    if ttfts:
        p50, p95 = 1000 * statistics.median(ttfts), 1000 * _pct(ttfts, 0.95)
        lines.append(f"TTFT p50 {p50:.1f} ms, p95 {p95:.1f} ms")
    if overheads:
        lines.append(
            f"proxy overhead (x-marsproxy-overhead-ms) p50 {statistics.median(overheads):.2f} ms,"
            f" p99 {_pct(overheads, 0.99):.2f} ms"
        )
    for url, s in zip(main.urls, main.samples, strict=True):
        queries = s.counters.get("vllm:prefix_cache_queries_total", 0.0)
        hits = s.counters.get("vllm:prefix_cache_hits_total", 0.0)
        lines.append(
            f"worker {url}: requests {s.counters.get('vllm:request_success_total', 0):.0f},"
            f" KV usage peak {100 * s.kv_peak:.0f}%, running peak {s.running_peak:.0f},"
            f" waiting peak {s.waiting_peak:.0f},"
            f" preemptions {s.counters.get('vllm:num_preemptions_total', 0):.0f},"
            f" prefix-cache hit rate {100 * hits / queries if queries else 0:.0f}%"
        )
    lines.extend(_admission_lines(main.events))
    lines.append("")
    lines.extend(_timeline_lines(main, sample_s, replicas))
    if len(runs) > 1:
        lines.append("")
        lines.append("the same load, side by side (fresh workers each):")
        for run in runs:
            lines.extend(_run_lines(run))
    failures = [t.error for t in turns if not t.ok]
    if failures:
        lines.append(f"first failure: {failures[0]}")
    lines.append("deploy it: deploy/README.md · point agents at it: docs/integrations.md")
    return "\n".join(lines) + "\n"
