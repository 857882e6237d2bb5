"""The KV ledger: blocks reserved for dormant sessions' retained prefixes.

vLLM has no pinning API, so retention is made real by accounting: the admission budget
subtracts the blocks reserved here, so new work is not admitted into the room a retained
prefix needs and cannot push it out of the prefix cache. A reservation lives until its TTL
ends, its session returns, or KV pressure drops it (least urgent first).

Pure code: no I/O, no clock; ``now`` is a parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Reservation:
    session: str
    worker: str
    blocks: int
    level: int  # level of its last call (las; LOWEST without levels); higher is dropped first
    reserved_at: float
    expires_at: float


class KvLedger:
    """Reservations by session (a session holds at most one, on its worker)."""

    def __init__(self) -> None:
        self._by_session: dict[str, Reservation] = {}
        self._blocks: dict[str, int] = {}  # worker → blocks reserved there (kept as they go)

    def _put(self, r: Reservation) -> None:
        old = self._by_session.get(r.session)
        if old is not None:  # replaced in place: the dict's order stays as it was
            self._blocks[old.worker] -= old.blocks
        self._by_session[r.session] = r
        self._blocks[r.worker] = self._blocks.get(r.worker, 0) + r.blocks

    def _pop(self, session: str) -> Reservation | None:
        r = self._by_session.pop(session, None)
        if r is not None:
            self._blocks[r.worker] -= r.blocks
        return r

    def reserve(
        self, session: str, worker: str, blocks: int, now: float, ttl_s: float, level: int
    ) -> Reservation:
        """Reserves ``blocks`` on ``worker`` until ``now + ttl_s``; replaces an older one."""
        if blocks < 0:
            raise ValueError(f"blocks must not be negative, got {blocks}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        r = Reservation(session, worker, blocks, level, now, now + ttl_s)
        self._put(r)
        return r

    def release_on_return(self, session: str) -> Reservation | None:
        """The session came back: its prefix is in use again, so it needs no reservation."""
        return self._pop(session)

    def correct(self, session: str, blocks: int) -> Reservation | None:
        """The engine evicted part of ``session``'s retained prefix: keep ``blocks`` reserved
        (fewer only; returns the corrected reservation, or None when nothing changed)."""
        r = self._by_session.get(session)
        if r is None or blocks >= r.blocks:
            return None
        self._put(r := replace(r, blocks=max(0, blocks)))
        return r

    def expire(self, now: float) -> list[Reservation]:
        """Drops reservations whose TTL has ended (at ``expires_at`` exactly, too)."""
        gone = [r for r in self._by_session.values() if r.expires_at <= now]
        for r in gone:
            self._pop(r.session)
        return gone

    def reserved_blocks(self, worker: str) -> int:
        """Blocks the admission budget must not promise on ``worker``."""
        return self._blocks.get(worker, 0)

    def reservation(self, session: str) -> Reservation | None:
        return self._by_session.get(session)

    def reservations(self, worker: str | None = None) -> list[Reservation]:
        """Live reservations (of one worker, or all), oldest first: for the state endpoint."""
        rs = [r for r in self._by_session.values() if worker is None or r.worker == worker]
        return sorted(rs, key=lambda r: (r.reserved_at, r.session))

    def drop_under_pressure(self, worker: str, blocks_needed: int) -> list[Reservation]:
        """Frees at least ``blocks_needed`` blocks on ``worker`` if reservations allow.

        Dormant sessions go before running work is held back; among them the least urgent
        (highest level) first, then the oldest, so the sessions most likely to be cheap
        and soon keep their prefix. Drops nothing when nothing is needed; when all its
        reservations together are too few, drops them all. Returns what it dropped.
        """
        if blocks_needed <= 0:
            return []
        order = sorted(
            (r for r in self._by_session.values() if r.worker == worker),
            key=lambda r: (-r.level, r.reserved_at, r.session),
        )
        dropped: list[Reservation] = []
        freed = 0
        for r in order:
            if freed >= blocks_needed:
                break
            self._pop(r.session)
            dropped.append(r)
            freed += r.blocks
        return dropped

    def __len__(self) -> int:
        return len(self._by_session)
