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
returns holds only what its one call holds.

Pure code: no I/O, no clock.
"""

from __future__ import annotations

from collections import deque


class ReturnTally:
    """Per tenant, the outcomes of its latest first dormancies (``history`` of them)."""

    def __init__(self, history: int) -> None:
        if history < 1:
            raise ValueError(f"history must be ≥ 1, got {history}")
        self._history = history
        self._seen: dict[str, deque[bool]] = {}

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
        remembered and fewer than half of it came back (too little seen: no)."""
        seen = self._seen.get(tenant)
        return seen is not None and len(seen) == seen.maxlen and 2 * sum(seen) < len(seen)

    def rates(self) -> dict[str, tuple[int, int]]:
        """Per tenant: (came back, remembered)."""
        return {t: (sum(s), len(s)) for t, s in self._seen.items()}
