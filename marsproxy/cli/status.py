"""``marsproxy status``: the proxy's ``/mars/v1/state`` document as a readable table.

:func:`render_state` is pure (a document and a width in, text out) so it can be tested on
hand-made documents; :func:`fetch_state` and :func:`run_status` do the I/O. Rendering is
lenient on purpose: the state document grows over versions (admission windows, ...), so unknown
keys are ignored and missing or mistyped values print as "-" instead of failing.

Units in the document: ``kv_usage``, ``prefix_cache_hit_rate`` and ``gpu.memory_used_frac`` are
fractions (0..1); PSI ``avg10``/``avg60``, ``cpu_percent`` and ``gpu.utilization_pct`` are
already percent (0..100).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from marsproxy.aimd.controller import NO_CEILING

DEFAULT_URL = "http://127.0.0.1:8080"
URL_ENV = "MARSPROXY_URL"
STATE_PATH = "/mars/v1/state"
# Clear screen and home the cursor; written together with the frame so the screen never
# shows a blank state between two refreshes.
CLEAR = "\x1b[H\x1b[2J"
DASH = "-"


class StatusError(Exception):
    """The state could not be fetched; the message is one line meant for the user."""


# -- formatting of single values ------------------------------------------------------------


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


# -- tables ---------------------------------------------------------------------------------

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
        limit = row.get("limit")
        shown = "∞" if isinstance(limit, int) and limit >= NO_CEILING else fmt_int(limit)
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


# -- I/O ------------------------------------------------------------------------------------


def state_url(base: str, sessions: bool) -> str:
    return base.rstrip("/") + STATE_PATH + ("?sessions=1" if sessions else "")


TOKEN_ENV = "MARSPROXY_AUTH__ADMIN_TOKEN"  # the same variable the proxy reads auth.admin_token from


def fetch_state(
    base: str, *, sessions: bool = False, timeout_s: float = 5.0, token: str | None = None
) -> dict[str, Any]:
    """GET the state document; any failure becomes a one-line :class:`StatusError`."""
    if not base.startswith(("http://", "https://")):
        raise StatusError(f"bad URL {base!r}: give it as http://HOST:PORT")
    url = state_url(base, sessions)
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        raise StatusError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise StatusError(f"cannot reach marsproxy at {base}: {exc.reason}") from None
    except (TimeoutError, OSError) as exc:
        raise StatusError(f"cannot reach marsproxy at {base}: {exc}") from None
    except ValueError as exc:  # e.g. a port that is not a number
        raise StatusError(f"bad URL {base!r}: {exc}") from None
    try:
        doc = json.loads(body)
    except ValueError:
        raise StatusError(f"{url}: the answer is not JSON") from None
    if not isinstance(doc, dict):
        raise StatusError(f"{url}: the answer is not a JSON object")
    return doc


def _width() -> int:
    return shutil.get_terminal_size((120, 40)).columns


def run_status(
    url: str,
    *,
    watch: bool = False,
    interval_s: float = 1.0,
    sessions: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
    token: str | None = None,
) -> int:
    """Print the state once (exit 1 when unreachable), or refresh it until Ctrl-C."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    if not watch:
        try:
            doc = fetch_state(url, sessions=sessions, token=token)
        except StatusError as exc:
            err.write(f"marsproxy status: {exc}\n")
            return 1
        out.write(render_state(doc, _width()))
        return 0
    try:
        while True:
            began = time.monotonic()
            try:
                frame = render_state(fetch_state(url, sessions=sessions, token=token), _width())
            except StatusError as exc:
                # Keep retrying: a proxy that restarts should reappear by itself.
                frame = f"marsproxy status: {exc}\n(retrying every {interval_s:g} s)\n"
            out.write(f"{CLEAR}{frame}\n{url}, every {interval_s:g} s; Ctrl-C to quit\n")
            out.flush()
            time.sleep(max(0.0, interval_s - (time.monotonic() - began)))
    except KeyboardInterrupt:
        out.write("\n")
        return 0


def default_url(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(URL_ENV) or DEFAULT_URL


def _positive(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Options of ``marsproxy status`` (the CLI adds the subcommand and calls this)."""
    p.add_argument(
        "--url", default=default_url(),
        help=f"proxy base URL (env {URL_ENV} sets the default)",
    )
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p.add_argument(
        "--interval", type=_positive, default=1.0, metavar="S",
        help="seconds between refreshes with --watch",
    )
    p.add_argument("--sessions", action="store_true", help="also list the sessions")
    p.set_defaults(func=_cmd_status)


def _cmd_status(args: argparse.Namespace) -> int:
    # The admin token from the environment only: a flag would show in the process list.
    return run_status(
        args.url, watch=args.watch, interval_s=args.interval, sessions=args.sessions,
        token=os.environ.get(TOKEN_ENV) or None,
    )
