"""Tool-phase tracking: which sessions are running tools now, and how long tools take.

A session is in a tool phase from the end of an LLM response to its next request (inferred),
unless its agent harness reports ``tool_start``/``tool_end`` itself (explicit): once a session
sent an explicit event, inference stops for it, so the two never double-count.

Kept: tools in flight, backlog ratio (pressing tools / tool CPUs), an EMA of reported tool queue
wait, per-session and per-tool-kind duration estimates (a high quantile of recent durations,
because tool times are heavy-tailed and a mean would under-predict), and tool slowdown (EMA of
observed / usual duration for the kind, > 1 when tools contend for CPUs).

An inferred phase presses on the tool CPUs (counts in the backlog ratio) only once it has lasted
``inferred_min_s``: a gap of a few milliseconds between calls is a client's own overhead (or
a client that runs no tools at all), not a tool competing for cores. Explicit phases press at
once. Whether inferred phases count at all is the caller's choice (``inferred=False``): a gap
between calls is a tool on this host only where tools run here and the CPUs show it
(:mod:`marsproxy.probes.tool_signal`).

Pure code: no I/O; ``now`` is a parameter; methods return the events to publish.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, field

from marsproxy.core.events import Event, ToolEnd, ToolStart

UNKNOWN_TOOL = "unknown"


@dataclass(frozen=True)
class ToolTrackerSettings:
    ema_alpha: float = 0.2
    quantile: float = 0.9
    history: int = 64  # durations kept per session and per tool kind
    tool_cpus: float = 1.0
    inferred_min_s: float = 0.5  # an inferred phase presses on the CPUs from this age on


def quantile(values: deque[float] | list[float], q: float) -> float | None:
    """Nearest-rank quantile; None when there is nothing to estimate from."""
    if not values:
        return None
    ordered = sorted(values)
    return _rank(ordered, q)


def _rank(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class _Window:
    """The last ``size`` durations, also kept sorted: a quantile is an index, not a sort (the
    tracker asks for one on every closed tool phase, that is on every request)."""

    __slots__ = ("_order", "_size", "_sorted")

    def __init__(self, size: int) -> None:
        self._size = size
        self._order: deque[float] = deque()
        self._sorted: list[float] = []

    def add(self, value: float) -> None:
        self._order.append(value)
        insort(self._sorted, value)
        if len(self._order) > self._size:
            old = self._order.popleft()
            del self._sorted[bisect_left(self._sorted, old)]

    def quantile(self, q: float) -> float | None:
        """As :func:`quantile` of the window."""
        return _rank(self._sorted, q) if self._sorted else None


@dataclass
class _SessionTools:
    explicit: bool = False
    phase_start: float | None = None  # open tool phase (inferred or explicit)
    phase_tool: str = UNKNOWN_TOOL
    phase_id: int = 0  # tells a young-phase entry from a later phase of the same session
    pressing: bool = False  # counted in the backlog
    last_tool: str = UNKNOWN_TOOL
    durations: _Window = field(default_factory=lambda: _Window(0))  # sized by the tracker


class ToolPhaseTracker:
    def __init__(self, settings: ToolTrackerSettings) -> None:
        self.settings = settings
        self._sessions: dict[str, _SessionTools] = {}
        self._by_kind: dict[str, _Window] = {}
        self.in_flight = 0  # open phases, inferred or explicit
        self.explicit_in_flight = 0  # open phases the harness reported
        self._pressing = 0  # explicit phases + inferred phases older than inferred_min_s
        self._pressing_explicit = 0
        self._young: deque[tuple[float, str, int]] = deque()  # inferred: (start, session, id)
        self._next_id = 0
        self.queue_wait_ema: float = 0.0
        self.slowdown_ema: float = 1.0
        self.completed_total = 0

    # -- inputs ---------------------------------------------------------------------------
    def response_ended(self, session: str, now: float) -> list[Event]:
        """An LLM response finished: an inferred tool phase begins (if not explicit)."""
        st = self._sessions.get(session)
        if st is None:
            st = self._sessions[session] = self._new_session()
        if st.explicit or st.phase_start is not None:
            return []
        return [self._open(session, st, now, st.last_tool, inferred=True, queue_wait=None)]

    def request_started(self, session: str, now: float) -> list[Event]:
        """The session's next request arrived: its inferred tool phase ends."""
        st = self._sessions.get(session)
        if st is None or st.explicit or st.phase_start is None:
            return []
        return [self._close(session, st, now, inferred=True)]

    def explicit_event(
        self, session: str, kind: str, tool: str, now: float, queue_wait_s: float | None
    ) -> list[Event]:
        """``tool_start``/``tool_end`` reported by the agent harness; overrides inference."""
        st = self._sessions.get(session)
        if st is None:
            st = self._sessions[session] = self._new_session()
        out: list[Event] = []
        if not st.explicit and st.phase_start is not None:
            # An inferred phase was open; the explicit report replaces it, uncounted.
            st.phase_start = None
            self.in_flight -= 1
            self._unpress(st)
        st.explicit = True
        if kind == "tool_start":
            if st.phase_start is not None:  # a start without end: close the previous one
                out.append(self._close(session, st, now, inferred=False))
            out.append(self._open(session, st, now, tool, inferred=False, queue_wait=queue_wait_s))
        elif st.phase_start is not None:
            out.append(self._close(session, st, now, inferred=False))
        return out

    def session_ended(self, session: str) -> None:
        st = self._sessions.pop(session, None)
        if st is not None and st.phase_start is not None:
            self.in_flight -= 1
            self.explicit_in_flight -= 1 if st.explicit else 0
            self._unpress(st)

    # -- estimates ------------------------------------------------------------------------
    def pressing(self, now: float, *, inferred: bool = True) -> int:
        """Tool phases pressing on the tool CPUs at ``now`` (see the module doc);
        ``inferred`` False: only those the harness reported."""
        if not inferred:
            return self._pressing_explicit
        horizon = now - self.settings.inferred_min_s
        young = self._young
        while young and young[0][0] <= horizon:
            _, session, phase_id = young.popleft()
            st = self._sessions.get(session)
            if st is not None and st.phase_start is not None and st.phase_id == phase_id:
                st.pressing = True
                self._pressing += 1
        return self._pressing

    def backlog_ratio(self, now: float, *, inferred: bool = True) -> float:
        cpus = self.settings.tool_cpus
        return self.pressing(now, inferred=inferred) / cpus if cpus > 0 else 0.0

    def predicted_duration(self, session: str, tool: str | None = None) -> float | None:
        """High quantile of the tool kind's recent durations, else of the session's."""
        q = self.settings.quantile
        st = self._sessions.get(session)
        kind = tool or (st.last_tool if st else UNKNOWN_TOOL)
        window = self._by_kind.get(kind)
        by_kind = window.quantile(q) if window is not None else None
        by_session = st.durations.quantile(q) if st else None
        estimates = [e for e in (by_kind, by_session) if e is not None]
        return max(estimates) if estimates else None

    def usual_duration(self, tool: str) -> float | None:
        window = self._by_kind.get(tool)
        return window.quantile(0.5) if window is not None else None

    def in_reported_tool(self, session: str) -> bool:
        """Whether ``session``'s harness reported a tool of it that has not ended yet."""
        st = self._sessions.get(session)
        return st is not None and st.explicit and st.phase_start is not None

    def sessions_in_tool_phase(self) -> list[tuple[str, str, float]]:
        """(session, tool, phase start) of every open tool phase."""
        return [
            (s, st.phase_tool, st.phase_start)
            for s, st in self._sessions.items()
            if st.phase_start is not None
        ]

    # -- internals ------------------------------------------------------------------------
    def _new_session(self) -> _SessionTools:
        return _SessionTools(durations=_Window(self.settings.history))

    def _unpress(self, st: _SessionTools) -> None:
        # A young entry left in the deque is skipped later: its phase id no longer matches.
        if st.pressing:
            st.pressing = False
            self._pressing -= 1
            self._pressing_explicit -= 1 if st.explicit else 0

    def _open(
        self, session: str, st: _SessionTools, now: float, tool: str, *, inferred: bool,
        queue_wait: float | None,
    ) -> Event:
        st.phase_start = now
        st.phase_tool = tool
        self.in_flight += 1
        self._next_id += 1
        st.phase_id = self._next_id
        self.explicit_in_flight += 0 if inferred else 1
        if inferred and self.settings.inferred_min_s > 0:
            self._young.append((now, session, st.phase_id))
        else:
            st.pressing = True
            self._pressing += 1
            self._pressing_explicit += 0 if inferred else 1
        if queue_wait is not None:
            a = self.settings.ema_alpha
            self.queue_wait_ema = a * queue_wait + (1 - a) * self.queue_wait_ema
        return ToolStart(ts=now, session=session, tool=tool, inferred=inferred,
                         queue_wait_s=queue_wait)

    def _close(self, session: str, st: _SessionTools, now: float, *, inferred: bool) -> Event:
        assert st.phase_start is not None
        duration = max(0.0, now - st.phase_start)
        tool = st.phase_tool
        st.phase_start = None
        st.last_tool = tool
        self.in_flight -= 1
        self.explicit_in_flight -= 0 if inferred else 1
        self._unpress(st)
        self.completed_total += 1
        usual = self.usual_duration(tool)
        if usual is not None and usual > 0:
            a = self.settings.ema_alpha
            self.slowdown_ema = a * (duration / usual) + (1 - a) * self.slowdown_ema
        by_kind = self._by_kind.get(tool)
        if by_kind is None:
            by_kind = self._by_kind[tool] = _Window(self.settings.history)
        st.durations.add(duration)
        by_kind.add(duration)
        return ToolEnd(ts=now, session=session, tool=tool, inferred=inferred, duration_s=duration)
