"""The state document as text: pure (a document and a width in, text out), so it can be tested
on hand-made documents. Lenient on purpose: the document grows over versions, so unknown keys
are ignored and missing or mistyped values print as "-" instead of failing.

Units in the document: ``kv_usage``, ``prefix_cache_hit_rate`` and ``gpu.memory_used_frac`` are
fractions (0..1); PSI ``avg10``/``avg60``, ``cpu_percent`` and ``gpu.utilization_pct`` are
already percent (0..100).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

DASH = "-"


def _num(v: object) -> float | None:
    """A finite number, or None for null, missing, NaN/inf and non-numbers (bools included)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def fmt_int(v: object) -> str:
    f = _num(v)
    return DASH if f is None else f"{f:.0f}"


def fmt_float(v: object, digits: int = 2, unit: str = "") -> str:
    f = _num(v)
    return DASH if f is None else f"{f:.{digits}f}{unit}"


def fmt_frac_pct(v: object, digits: int = 1) -> str:
    """A fraction (0..1) as a percentage: 0.4312 → "43.1%"."""
    f = _num(v)
    return DASH if f is None else f"{100.0 * f:.{digits}f}%"


def fmt_pct(v: object, digits: int = 1) -> str:
    """A value already in percent (0..100): 12.34 → "12.3%"."""
    f = _num(v)
    return DASH if f is None else f"{f:.{digits}f}%"


def bar(frac: object, cells: int) -> str:
    """``[####......]`` with ``cells`` cells; empty string when ``cells`` is 0 or no value."""
    f = _num(frac)
    if cells <= 0 or f is None:
        return ""
    filled = round(min(1.0, max(0.0, f)) * cells)
    return "[" + "#" * filled + "." * (cells - filled) + "]"


def _map(v: object) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _list(v: object) -> list[Mapping[str, Any]]:
    if not isinstance(v, list):
        return []
    return [x for x in v if isinstance(x, Mapping)]


def _text(v: object) -> str:
    return DASH if v is None else str(v)


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: max(0, n - 1)] + "…"


Column = tuple[str, Callable[[Mapping[str, Any]], str], bool]
"""(header, cell of a row, right-aligned?)"""


def _table(
    rows: Sequence[Mapping[str, Any]], cols: Sequence[Column], indent: str = "  "
) -> list[str]:
    cells = [[fn(r) for _, fn, _ in cols] for r in rows]
    widths = [
        max([len(h), *(len(c[i]) for c in cells)]) for i, (h, _, _) in enumerate(cols)
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if right else v.ljust(w)
            for v, w, (_, _, right) in zip(values, widths, cols, strict=True)
        ]
        return (indent + "  ".join(parts)).rstrip()

    return [line([h for h, _, _ in cols]), *(line(c) for c in cells)]


def _health(w: Mapping[str, Any]) -> str:
    h = w.get("healthy")
    return DASH if not isinstance(h, bool) else ("ok" if h else "DOWN")


def _sample(w: Mapping[str, Any]) -> str:
    """Freshness of the last metrics sample: "0.12s", "STALE 3.4s", "STALE never"."""
    age = fmt_float(w.get("age_s"), 2, "s")
    if w.get("stale") is True:
        return "STALE " + ("never" if age == DASH else age)
    return age


def _gpu(w: Mapping[str, Any]) -> str:
    g = w.get("gpu")
    if not isinstance(g, Mapping):
        return DASH
    if g.get("available") is not True:
        return "n/a"
    mem = fmt_frac_pct(g.get("memory_used_frac"), 0)
    return f"mem {mem} util {fmt_pct(g.get('utilization_pct'), 0)}"


NAME_MAX = 32
"""Longest worker name shown in full; longer ones are clipped with "…"."""


def _worker_columns(bar_cells: int) -> list[Column]:
    def kv(w: Mapping[str, Any]) -> str:
        pct = fmt_frac_pct(w.get("kv_usage"))
        b = bar(w.get("kv_usage"), bar_cells)
        return f"{pct:>6} {b}" if b else pct

    return [
        ("worker", lambda w: _clip(_text(w.get("name")), NAME_MAX), False),
        ("health", _health, False),
        ("sample", _sample, False),
        ("KV", kv, False),
        ("run", lambda w: fmt_int(w.get("running")), True),
        ("wait", lambda w: fmt_int(w.get("waiting")), True),
        ("preempt/s", lambda w: fmt_float(w.get("preemptions_per_s")), True),
        ("prefix hit", lambda w: fmt_frac_pct(w.get("prefix_cache_hit_rate")), True),
        ("prefill tok/s", lambda w: fmt_float(w.get("prefill_tokens_per_s"), 0), True),
        ("sess", lambda w: fmt_int(w.get("sessions")), True),
        ("in-flight", lambda w: fmt_int(w.get("requests_in_flight")), True),
        ("errors", lambda w: fmt_int(w.get("scrape_errors")), True),
        # probes.vllm.period_s while the worker serves or sessions wait, idle_period_s idle.
        ("every", lambda w: fmt_float(w.get("scrape_period_s"), 1, "s"), True),
        ("GPU", _gpu, False),
    ]


def _workers_table(workers: Sequence[Mapping[str, Any]], width: int) -> list[str]:
    """The widest KV bar that still fits ``width``; without a bar the table may overflow
    (the terminal wraps it) rather than lose numbers."""
    lines: list[str] = []
    for cells in (10, 5, 0):
        lines = _table(workers, _worker_columns(cells))
        if max(len(x) for x in lines) <= width:
            break
    return lines


_SESSION_COLUMNS: list[Column] = [
    ("session", lambda s: _clip(_text(s.get("id")), 40), False),
    ("worker", lambda s: _text(s.get("worker")), False),
    ("state", lambda s: _text(s.get("state")), False),
    ("turns", lambda s: fmt_int(s.get("turns")), True),
    ("tool", lambda s: _text(s.get("tool")), False),
    ("since", lambda s: fmt_float(s.get("since_s"), 1, "s"), True),
]


def _header(doc: Mapping[str, Any]) -> str:
    t = _num(doc.get("time"))
    when = DASH if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    return f"marsproxy {_text(doc.get('version'))}   state at {when}"


def _cpu_tools(doc: Mapping[str, Any]) -> list[str]:
    cpu, tools = _map(doc.get("cpu")), _map(doc.get("tools"))
    throttled = cpu.get("throttled_usec")
    return [
        f"CPU    source {_text(cpu.get('source'))}"
        f"   PSI some avg10 {fmt_pct(cpu.get('psi_some_avg10'))}"
        f" avg60 {fmt_pct(cpu.get('psi_some_avg60'))}"
        f"   throttled {DASH if _num(throttled) is None else fmt_int(throttled) + ' us'}"
        f"   cpu {fmt_pct(cpu.get('cpu_percent'))}"
        f"   tool CPUs {fmt_float(cpu.get('tool_cpus'), 1)}",
        f"Tools  in flight {fmt_int(tools.get('in_flight'))}"
        f"   backlog ratio {fmt_float(tools.get('backlog_ratio'))}"
        f"   wait EMA {fmt_float(tools.get('queue_wait_ema_s'), 3, ' s')}"
        f"   slowdown {fmt_float(tools.get('slowdown_ema'), 2, 'x')}",
    ]


def _sessions(doc: Mapping[str, Any]) -> list[str]:
    sess = _map(doc.get("sessions"))
    by_state = _map(sess.get("by_state"))
    # Known states first in a fixed order, then whatever a newer proxy adds.
    known = ("llm", "tool", "idle")
    states = [*known, *sorted(k for k in by_state if k not in known)]
    counts = ", ".join(f"{k} {fmt_int(by_state.get(k))}" for k in states)
    lines = [f"Sessions  total {fmt_int(sess.get('total'))}   {counts}"]
    details = _list(sess.get("details"))
    if "details" in sess:
        lines.append("")
        if details:
            lines.extend(_table(details, _SESSION_COLUMNS))
        else:
            lines.append("  (no sessions)")
        lines.append("")
    return lines


def _admission(doc: Mapping[str, Any]) -> list[str]:
    """Window, limit and admitted per worker, and the queue (nothing when admission is off)."""
    adm = _map(doc.get("admission"))
    if not adm:
        return []
    cells = []
    for name, w in sorted(_map(adm.get("workers")).items()):
        row = _map(w)
        flags = [f for f in ("kv", "cpu") if row.get(f"{f}_overloaded") is True]
        over = f" ({'+'.join(flags)} overload)" if flags else ""
        ovc = row.get("peak_overcommit")
        # The fit's factor only where the measured overlap (or cheap preemption) lifted it.
        fit = f" fit x{ovc:.2f}" if isinstance(ovc, (int, float)) and ovc > 1.0 else ""
        # binds "none": no count bound (not overloaded, no window_max); the KV fit decides.
        shown = "∞" if row.get("binds") == "none" else fmt_int(row.get("limit"))
        cells.append(
            f"{name} {fmt_int(row.get('admitted'))}/{shown}"
            f" win {fmt_int(row.get('window'))}{fit}{over}"
        )
    q, st = _map(adm.get("queue")), _map(adm.get("store"))
    leader = " leader" if st.get("is_leader") is True else ""
    return [
        "Admission  " + ("   ".join(cells) if cells else DASH),
        f"Queue     waiting {fmt_int(q.get('length'))}   pending {fmt_int(q.get('pending'))}"
        f"   mode {_text(q.get('mode'))}   retry-after {fmt_int(q.get('retry_after_s'))} s"
        f"   store {_text(st.get('backend'))}/{_text(st.get('mode'))}{leader}",
    ]


def _scheduler(doc: Mapping[str, Any]) -> list[str]:
    """Policies and warm resumes; per worker its priority mode, gate and KV ledger."""
    sched = _map(doc.get("scheduler"))
    if not sched:
        return []
    r = _map(sched.get("resumes"))
    hit = r.get("hit_rate")
    lines = [
        f"Scheduler priority {_text(sched.get('priority_policy'))}"
        f"   retention {_text(sched.get('retention_policy'))}"
        f"   hints {_text(sched.get('hint_encoder'))}"
        f"   warm resumes {fmt_int(r.get('warm'))}/{fmt_int(_sum(r.get('warm'), r.get('cold')))}"
        + (f" ({100 * hit:.0f}%)" if isinstance(hit, (int, float)) else "")
    ]
    for w in _list(doc.get("workers")):
        ws = _map(_map(w).get("scheduler"))
        if ws:
            lines.append(
                f"  {_text(_map(w).get('name'))}: {_text(ws.get('mode'))}"
                f"   in flight {fmt_int(ws.get('in_flight'))}/{fmt_int(ws.get('cap'))}"
                f"   held {fmt_int(ws.get('queue_length'))}"
                f"   retained {fmt_int(ws.get('retained_blocks'))} blocks"
                f" ({len(_list(ws.get('reservations')))} sessions)"
            )
    return lines


def _sum(*xs: Any) -> int | None:
    vals = [x for x in xs if isinstance(x, int)]
    return sum(vals) if len(vals) == len(xs) else None


def render_state(doc: Mapping[str, Any], width: int) -> str:
    """The state document as text, fitted to a terminal ``width`` columns wide where it can."""
    workers = _list(doc.get("workers"))
    lines = [_header(doc), ""]
    if workers:
        lines.extend(_workers_table(workers, width))
    else:
        lines.append("  (no workers)")
    lines.append("")
    lines.extend(_cpu_tools(doc))
    lines.extend(_sessions(doc))
    lines.extend(_admission(doc))
    lines.extend(_scheduler(doc))
    ev = _map(doc.get("events"))
    lines.append(
        f"Events    published {fmt_int(ev.get('published_total'))}"
        f"   dropped {fmt_int(ev.get('dropped_total'))}"
        f"   subscribers {fmt_int(ev.get('subscribers'))}"
    )
    return "\n".join(lines) + "\n"
