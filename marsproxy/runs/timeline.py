"""Time series for the plots, read from the proxy's event stream (``GET /mars/v1/events``).

The live benchmark records the stream as dicts (:func:`marsproxy.core.events.event_to_dict`);
the simulator publishes the same event types from the same core, so both feed this one function.

Series (``t`` in seconds from ``t0``):
- ``window``: sum over workers of the latest admission window (``window_change.new``);
- ``kv_usage``: mean over workers of the latest ``pressure_sample.kv_usage``;
- ``cpu_backlog``: ``pressure_sample.backlog_ratio`` (tools in flight / tool CPUs);
- ``tools_in_flight``: ``pressure_sample.tools_in_flight``;
- ``queue``: sessions waiting for admission (queued, not yet admitted or rejected).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Series = list[tuple[float, float]]


def timeline(events: Iterable[Mapping[str, Any]], t0: float,
             ts_key: str = "ts") -> dict[str, Series]:
    """The series; ``ts_key`` names the timestamp field (the live benchmark's receipt time)."""
    out: dict[str, Series] = {
        "window": [], "kv_usage": [], "cpu_backlog": [], "tools_in_flight": [], "queue": [],
    }
    windows: dict[str, float] = {}
    kv: dict[str, float] = {}
    waiting: set[str] = set()
    for ev in events:
        kind = ev.get("type")
        t = float(ev.get(ts_key, t0)) - t0
        worker = str(ev.get("worker") or "")
        session = ev.get("session")
        if kind == "window_change":
            windows[worker] = float(ev.get("new", 0.0))
            out["window"].append((t, sum(windows.values())))
        elif kind == "pressure_sample":
            usage = ev.get("kv_usage")
            if usage is not None:
                kv[worker] = float(usage)
                out["kv_usage"].append((t, sum(kv.values()) / len(kv)))
            out["cpu_backlog"].append((t, float(ev.get("backlog_ratio") or 0.0)))
            out["tools_in_flight"].append((t, float(ev.get("tools_in_flight") or 0)))
        elif kind == "session_queued" and session is not None:
            waiting.add(str(session))
            out["queue"].append((t, float(len(waiting))))
        elif kind in ("session_admitted", "rejected", "session_end") and str(session) in waiting:
            waiting.discard(str(session))
            out["queue"].append((t, float(len(waiting))))
    return out
