"""Whether a tenant's sessions come back after their first call.

An agent's session returns after each tool phase; a plain client's one-shot task (its own
session, no final flag) never does. Only a session that returns needs KV room held for it while
it is away, and after a single call nothing about the session itself says which kind it is. So
each tenant's latest sessions that went dormant after their first call are remembered as came
back (within their KV hold) or not, and a session dormant after its first call holds room only
where at least half of those came back. With nothing seen yet, none is held: holding room for a
session that never returns shuts out work the engine has room for, while an agent's first tool
phase unheld costs at most one re-prefill of its first prompt, and its tenant's first return
turns holding on.

A tenant whose full history is remembered and mostly did not come back sends one-shot tasks:
its new sessions are forecast without growth (``aimd/peak.py``), since a task that never
returns holds only what its one call holds. So does a tenant with a crowd of sessions in their
first gap at once (``crowd`` of them) while none of its remembered sessions came back: a batch
client finishes that many tasks within a second or two, long before the first of their holds
passes, while an agent's sessions start coming back once their first tools end; the first
return ends it.

Pure code: no I/O, no clock.
"""

from __future__ import annotations

from collections import deque


class ReturnTally:
    """Per tenant, the outcomes of its latest first dormancies (``history`` of them), and how
    many of its sessions are in a first dormancy now."""

    def __init__(self, history: int, crowd: int) -> None:
        if history < 1 or crowd < 1:
            raise ValueError(f"history and crowd must be ≥ 1, got {history} and {crowd}")
        self._history, self._crowd = history, crowd
        self._seen: dict[str, deque[bool]] = {}
        self._open: dict[str, int] = {}

    def gap_opened(self, tenant: str) -> None:
        """A session of ``tenant`` went dormant after its first call."""
        self._open[tenant] = self._open.get(tenant, 0) + 1

    def gap_closed(self, tenant: str) -> None:
        """One of ``tenant``'s first dormancies ended (back, judged, or the session ended)."""
        n = self._open.get(tenant, 0) - 1
        if n > 0:
            self._open[tenant] = n
        else:
            self._open.pop(tenant, None)

    def record(self, tenant: str, came_back: bool) -> None:
        seen = self._seen.get(tenant)
        if seen is None:
            seen = self._seen[tenant] = deque(maxlen=self._history)
        seen.append(came_back)

    def likely(self, tenant: str) -> bool:
        """Whether a session of ``tenant`` dormant after its first call is likely to return:
        at least half of the tenant's remembered ones did (none remembered: no)."""
        seen = self._seen.get(tenant)
        return seen is not None and 2 * sum(seen) >= len(seen)

    def one_shot(self, tenant: str) -> bool:
        """Whether ``tenant``'s sessions are known not to return: its whole history is
        remembered and fewer than half of it came back, or a crowd of its sessions is in a
        first dormancy and none remembered came back (too little seen: no)."""
        seen = self._seen.get(tenant)
        if self._open.get(tenant, 0) >= self._crowd and (seen is None or not any(seen)):
            return True
        return seen is not None and len(seen) == seen.maxlen and 2 * sum(seen) < len(seen)

    def rates(self) -> dict[str, tuple[int, int, int]]:
        """Per tenant: (came back, remembered, in a first dormancy now)."""
        out = {t: (sum(s), len(s), self._open.get(t, 0)) for t, s in self._seen.items()}
        for t, n in self._open.items():
            out.setdefault(t, (0, 0, n))
        return out
