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
        # session → (worker, end, blocks): its call ran at the worker's last reading and ended
        # since, and it is not back yet.
        self._freed: dict[str, tuple[str, float, int]] = {}
        self._freed_on: dict[str, int] = {}
        for w in workers:
            self._promised_on[w], self._freed_on[w] = 0, 0

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
        self._freed[session] = (worker, now, blocks)
        self._freed_on[worker] += blocks

    def resumed(self, session: str) -> None:
        """The session's next call: its blocks are its own again."""
        f = self._freed.pop(session, None)
        if f is not None:
            self._freed_on[f[0]] -= f[2]

    def read(self, worker: str, read_at: float | None) -> None:
        """The worker's gauge as read at ``read_at``: calls that ended by then are in it."""
        if not self._freed_on[worker]:
            return
        for session in [k for k, (w, end, _) in self._freed.items()
                        if w == worker and (read_at is None or end <= read_at)]:
            self.resumed(session)

    def freed_on(self, worker: str, used_blocks: int) -> int:
        """Blocks freed on ``worker`` since its reading, at most the ``used_blocks`` it read."""
        return max(0, min(self._freed_on[worker], used_blocks))
