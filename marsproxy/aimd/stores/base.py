"""The ``WindowStore`` interface: admission state that one or several replicas share.

The gateway talks only to this Protocol; :mod:`.memory` serves one replica, :mod:`.redis_store`
several replicas behind one Redis. Times are integer milliseconds on a clock the
replicas share (wall clock), passed in so that tests and the simulator drive them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol, runtime_checkable

# "memory": the in-process store; "shared": Redis is up; the others: Redis is down and
# ``on_store_failure`` is in effect.
StoreMode = Literal["memory", "shared", "local", "closed", "open"]

ClockMs = Callable[[], int]


def wall_clock_ms() -> int:
    """Epoch milliseconds: replicas on different hosts agree on it (NTP), unlike monotonic."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class WindowRecord:
    """One worker's admission window as the leader computed it."""

    limit: int  # effective limit: min(window, caps) — what admission checks against
    window: int  # the AIMD window before caps
    updated_ms: int
    reason: str = ""
    idle_limit: int | None = None
    """What an idle admission checks against (``admission.tuning.idle_admit``); ``None``: ``limit``
    (a record written before this field existed)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WindowRecord:
        d = json.loads(raw)
        idle = d.get("idle_limit")
        return cls(int(d["limit"]), int(d["window"]), int(d["updated_ms"]), str(d["reason"]),
                   None if idle is None else int(idle))


@dataclass(frozen=True, slots=True)
class HeldElsewhere:
    """``admit_if_ranked``'s answer when the session holds a live lease on another worker:
    another replica admitted it first (its first requests reached two replicas at once). No
    second lease was taken; claim that one (``claim``). False, as "not admitted here"."""

    worker: str

    def __bool__(self) -> bool:
        return False


@runtime_checkable
class WindowStore(Protocol):
    """Admission leases, leader-written windows, the global queue, wake-ups, session records."""

    @property
    def replica_id(self) -> str: ...

    @property
    def up(self) -> bool:
        """False while the shared backend is unreachable (the memory store is always up)."""

    @property
    def mode(self) -> StoreMode: ...

    @property
    def failures_total(self) -> int: ...

    @property
    def is_leader(self) -> bool: ...

    @property
    def live_replicas(self) -> int:
        """Replicas seen heartbeating (last known while down); divides windows in local mode."""

    async def start(self) -> None:
        """Start the heartbeat (and, for Redis, the wake-up listener)."""

    async def close(self) -> None:
        """Stop background work; leases are not released (they expire, as after a crash)."""

    async def try_admit(self, worker: str, session: str, limit: int, now_ms: int) -> bool:
        """Reap expired leases on ``worker``; admit iff live leases < ``limit``.

        Idempotent: a session already admitted on ``worker`` is renewed and gets True.
        """

    async def claim(self, worker: str, session: str, now_ms: int) -> bool:
        """Take over ``session``'s live lease on ``worker`` (another replica admitted it): the
        lease is renewed and owned by this replica from now on; the old owner's heartbeat
        finds it gone (``drain_lost``). False when no live lease exists (or the shared
        backend is down): then it is not admitted anywhere and must queue like a new one."""

    async def release(self, worker: str, session: str, *, any_owner: bool = False) -> bool:
        """End the session: drop its lease and its record, wake the replicas if sessions wait
        in the global queue. Fenced: unless ``any_owner`` (an explicit end on a replica that
        does not hold it), a lease another replica took over is left alone. True when a
        lease was dropped (exactly one caller gets True)."""

    def drain_lost(self) -> list[tuple[str, str]]:
        """(worker, session) of leases this replica held and found gone since the last call:
        taken over by another replica, ended there, or expired. Each is reported once."""

    async def renew(self, now_ms: int) -> int:
        """Heartbeat: renew this replica's leases, reap expired ones; returns leases renewed."""

    async def admitted(self, worker: str) -> int:
        """Live leases on ``worker`` (while the shared backend is down: this replica's own)."""

    async def admitted_counts(self, workers: Sequence[str]) -> dict[str, int]:
        """``admitted`` of every worker in one round trip."""

    async def admitted_sessions(self, worker: str) -> list[str]:
        """Sorted sessions holding a live lease on ``worker`` (down: this replica's own)."""

    async def try_lead(self, now_ms: int) -> bool:
        """Take or keep the leader lease; True while this replica is the leader."""

    async def publish_windows(self, windows: Mapping[str, WindowRecord]) -> bool:
        """Leader only: replace the windows hash; False if this replica is not the leader."""

    async def read_windows(self) -> dict[str, WindowRecord]:
        """The last published windows (the cached copy while the backend is down)."""

    async def enqueue(self, session: str, score: float) -> None:
        """Add or re-score a waiting session; lower scores are admitted first."""

    async def dequeue(self, session: str) -> None: ...

    async def queue_rank(self, session: str) -> int | None:
        """0-based position in the global queue; None when not waiting."""

    async def queue_len(self) -> int: ...

    async def admit_if_ranked(
        self, session: str, free_slots: int, worker: str, limit: int, now_ms: int,
        score: float | None = None, others: Sequence[str] = (),
    ) -> bool | HeldElsewhere:
        """Admit a queued session iff its rank < ``free_slots`` and ``worker`` has room.

        The rank check, the admission and the removal from the queue are one atomic step, so
        the global order holds across replicas. An already admitted session gets True. With
        ``score``, a session neither waiting nor admitted joins the queue first (as
        ``enqueue``), in the same step. ``others``: the pool's other workers; a session with a
        live lease on one of them leaves the queue and gets :class:`HeldElsewhere`.
        """

    async def exchange_counters(self, charges: Mapping[str, float]) -> dict[str, float] | None:
        """Add ``charges`` (virtual tokens per tenant) to the shared tenant counters and read
        them all back, in one round trip; ``None``: unreachable (whether the charges were added
        is unknown: the caller keeps them for the next exchange)."""

    async def notify(self) -> None:
        """Wake every replica's waiters (they re-check the queue)."""

    def wakeups(self) -> AsyncGenerator[None, None]:
        """Yields once per wake-up (coalesced); ``aclose()`` it when done waiting."""

    async def save_session(self, key: str, record: Mapping[str, Any]) -> None:
        """Store a JSON-serialisable session record for ``session_ttl_s``."""

    async def load_session(self, key: str) -> dict[str, Any] | None: ...

    async def delete_session(self, key: str) -> None: ...

    async def save_reply(self, reply: str, entry: str) -> None:
        """Keep ``entry`` (which session got the reply, from which worker) under the reply's
        ``reply_key`` for ``session_ttl_s``: a next call naming it may reach another replica."""

    async def load_reply(self, reply: str) -> str | None:
        """The entry kept for the reply (``None``: not known)."""


class WakeupHub:
    """Fans wake-ups out to local waiters; one pending wake-up per waiter is enough."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Queue[None]] = set()

    def fire(self) -> None:
        for q in self._waiters:
            if q.empty():  # coalesce: a waiter re-checks everything once anyway
                q.put_nowait(None)

    async def stream(self) -> AsyncGenerator[None, None]:
        q: asyncio.Queue[None] = asyncio.Queue(maxsize=1)
        self._waiters.add(q)
        try:
            while True:
                await q.get()
                yield None
        finally:
            self._waiters.discard(q)
