"""Worker placement: which worker serves a session.

Affinity keeps a session's prefix cache warm: a session stays on its worker while that worker
is healthy. A new session, or one whose worker left the healthy set, goes to the healthy
worker with the fewest sessions assigned, ties broken by configuration order.

Pure code: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


class Placement:
    def __init__(self, workers: Sequence[str]) -> None:
        self._order = {w: i for i, w in enumerate(workers)}
        self._of: dict[str, str] = {}  # session → worker
        self._load: dict[str, int] = dict.fromkeys(workers, 0)  # worker → sessions assigned

    def worker_of(self, session: str) -> str | None:
        return self._of.get(session)

    def load(self) -> dict[str, int]:
        """Sessions assigned per worker, in configuration order."""
        return dict(self._load)

    def assignments(self) -> dict[str, str]:
        return dict(self._of)

    def least_loaded(self, healthy: Collection[str], exclude: Collection[str] = ()) -> str | None:
        candidates = [w for w in self._order if w in healthy and w not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda w: (self._load[w], self._order[w]))

    def assign(
        self, session: str, healthy: Collection[str], exclude: Collection[str] = ()
    ) -> str | None:
        """The worker for ``session``; moves it if its worker is not healthy (or excluded).

        ``None`` when no worker qualifies; the session then keeps its old assignment, so it
        returns there if that worker recovers first.
        """
        current = self._of.get(session)
        if current is not None and current in healthy and current not in exclude:
            return current
        target = self.least_loaded(healthy, exclude)
        if target is None:
            return None
        if current is not None:
            self._load[current] -= 1
        self._of[session] = target
        self._load[target] += 1
        return target

    def pin(self, session: str, worker: str) -> None:
        """Put ``session`` on ``worker``: admission chose it (its slot and KV budget are there)."""
        current = self._of.get(session)
        if current == worker:
            return
        if current is not None:
            self._load[current] -= 1
        self._of[session] = worker
        self._load[worker] += 1

    def release(self, session: str) -> None:
        """The session was forgotten: its slot on the worker frees up."""
        worker = self._of.pop(session, None)
        if worker is not None:
            self._load[worker] -= 1
