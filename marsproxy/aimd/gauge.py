"""What a worker's free-block gauge does not show yet.

The KV budget starts from vLLM's usage gauge as last scraped (every ``probes.vllm.period_s``).
Between two scrapes the proxy knows two things the gauge cannot:

- *promised* blocks: sessions admitted whose first prompt the worker has not served yet. The
  gauge shows them only once the engine allocates them, so they are subtracted until their call
  ends (after which the gauge, or the forecast fit, counts them);
- *freed* blocks: calls that were running when the gauge was read and have ended since, of
  sessions that have not sent their next call yet. vLLM counts a finished request's blocks as
  free (cached, evictable), but the gauge read before still counts them, so they are added back
  until a newer reading shows them, or the session's next call takes them again; at most what
  that reading counted as used. Calls end every few hundred milliseconds on a busy worker, and a
  budget that missed them held sessions back while the engine had room.

Pure code: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable


class GaugeLag:
    def __init__(self, workers: Iterable[str]) -> None:
        self._promised: dict[str, tuple[str, int]] = {}  # session → (worker, blocks)
        self._promised_on: dict[str, int] = {}
        # Per worker, by session: (end, blocks) of calls running at its last reading that ended
        # since, of sessions not back yet.
        self._freed: dict[str, dict[str, tuple[float, int]]] = {}
        self._freed_on: dict[str, int] = {}
        self._freed_where: dict[str, str] = {}  # session → its worker, while it has an entry
        for w in workers:
            self._promised_on[w], self._freed[w], self._freed_on[w] = 0, {}, 0

    # -- promised ---------------------------------------------------------------------------
    def promise(self, session: str, worker: str, blocks: int) -> None:
        self.settle(session)
        self._promised[session] = (worker, blocks)
        self._promised_on[worker] += blocks

    def settle(self, session: str) -> None:
        """The session's first prompt was served (or it moved, or ended): no promise."""
        p = self._promised.pop(session, None)
        if p is not None:
            self._promised_on[p[0]] -= p[1]

    def is_promised(self, session: str) -> bool:
        return session in self._promised

    def promised_on(self, worker: str) -> int:
        return self._promised_on[worker]

    def promised(self) -> tuple[int, int]:
        """(sessions, blocks) promised on all workers."""
        return len(self._promised), sum(self._promised_on.values())

    # -- freed ------------------------------------------------------------------------------
    def ended(self, session: str, worker: str, started_at: float, now: float, blocks: int,
              read_at: float | None) -> None:
        """A call of ``session`` on ``worker`` that began at ``started_at`` ended at ``now``
        holding ``blocks``; ``read_at``: when the worker's gauge was last read (``None``:
        unknown)."""
        self.resumed(session)
        if read_at is None or started_at > read_at or blocks <= 0:
            return  # the reading cannot have counted it
        self._freed[worker][session] = (now, blocks)
        self._freed_on[worker] += blocks
        self._freed_where[session] = worker

    def resumed(self, session: str) -> None:
        """The session's next call (or its end): its blocks are its own again, or gone."""
        worker = self._freed_where.pop(session, None)
        if worker is not None:
            self._freed_on[worker] -= self._freed[worker].pop(session)[1]

    def read(self, worker: str, read_at: float | None) -> None:
        """The worker's gauge as read at ``read_at``: calls that ended by then are in it."""
        freed = self._freed[worker]
        for session in [k for k, (end, _) in freed.items() if read_at is None or end <= read_at]:
            self.resumed(session)

    def freed_on(self, worker: str, used_blocks: int) -> int:
        """Blocks freed on ``worker`` since its reading, at most the ``used_blocks`` it read."""
        return max(0, min(self._freed_on[worker], used_blocks))
