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
        # session → (worker, start, end, blocks): its call ended after the worker's latest
        # reading, and it is not back yet; the freed blocks are those of the calls the reading
        # counted as running (begun by then).
        self._ended: dict[str, tuple[str, float, float, int]] = {}
        self._ended_on: dict[str, set[str]] = {}
        self._freed_on: dict[str, int] = {}
        self._read_at: dict[str, float | None] = {}
        for w in workers:
            self._promised_on[w], self._freed_on[w] = 0, 0
            self._ended_on[w], self._read_at[w] = set(), None

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
    def ended(self, session: str, worker: str, started_at: float, now: float,
              blocks: int) -> None:
        """A call of ``session`` on ``worker`` that began at ``started_at`` ended at ``now``
        holding ``blocks``. Kept until a reading shows it ended or the session is back: a
        reading taken while it ran counts its blocks as used, also one that reaches the proxy
        only after its end (a scrape takes time, and the control tick applies it later)."""
        self.resumed(session)
        if blocks <= 0:
            return
        self._ended[session] = (worker, started_at, now, blocks)
        self._ended_on[worker].add(session)
        if self._counted(worker, started_at):
            self._freed_on[worker] += blocks

    def _counted(self, worker: str, started_at: float) -> bool:
        """Whether the worker's latest reading was taken after a call began (so counted it)."""
        at = self._read_at[worker]
        return at is not None and started_at <= at

    def resumed(self, session: str) -> None:
        """The session's next call: its blocks are its own again."""
        f = self._ended.pop(session, None)
        if f is not None:
            worker, started_at, _, blocks = f
            self._ended_on[worker].discard(session)
            if self._counted(worker, started_at):
                self._freed_on[worker] -= blocks

    def read(self, worker: str, read_at: float | None) -> None:
        """The worker's gauge as read at ``read_at``: calls that ended by then are in it as
        free, calls that ran then as used."""
        if read_at == self._read_at[worker]:
            return
        self._read_at[worker] = read_at
        freed = 0
        for session in list(self._ended_on[worker]):
            _, started_at, end, blocks = self._ended[session]
            if read_at is None or end <= read_at:
                self._ended_on[worker].discard(session)
                del self._ended[session]
            elif started_at <= read_at:
                freed += blocks
        self._freed_on[worker] = freed

    def freed_on(self, worker: str, used_blocks: int) -> int:
        """Blocks freed on ``worker`` since its reading, at most the ``used_blocks`` it read."""
        return max(0, min(self._freed_on[worker], used_blocks))
