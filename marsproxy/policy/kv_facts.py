"""What the workers' KV indexes tell the plane about retention (docs/kv-events.md).

Where a worker publishes KV events, the driver tells the plane, per tick, how many resident
blocks each session holds there (``WorkerObservation.session_blocks``), and, when a call
starts, how many leading tokens of its prompt are resident (``resident_tokens``). Two uses:

- **retention verified**: a session whose prefix the ledger retained resumes; the prefix found
  resident is ``kept`` (all of it but at most one block: the last prompt token is always
  computed), ``partly_kept`` (at least one block) or ``lost``;
- **the ledger corrected**: a retained session whose resident blocks fell below its reservation
  lost them to the engine's eviction (vLLM cannot pin); reserving room for blocks that are gone
  only holds back admissions, so the reservation shrinks to what is left.

Pure code: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping

from marsproxy.core.events import RetentionCorrected, RetentionVerified
from marsproxy.sched.ledger import KvLedger, Reservation


def retention_outcome(resident_tokens: int, reserved_tokens: int, block_size: int) -> str:
    """``kept``, ``partly_kept`` or ``lost``: a retained prefix at its session's resume."""
    if resident_tokens + block_size >= reserved_tokens:
        return "kept"
    return "partly_kept" if resident_tokens >= block_size else "lost"


def verify_retention(
    now: float, r: Reservation | None, worker: str, resident_tokens: int | None,
    block_size: int | None,
) -> RetentionVerified | None:
    """A call starts on ``worker`` with ``resident_tokens`` of its prompt resident there: how
    much of its session's retained prefix ``r`` survived (``None``: nothing to verify)."""
    if r is None or resident_tokens is None or r.worker != worker or not block_size:
        return None
    reserved = r.blocks * block_size
    return RetentionVerified(
        ts=now, session=r.session, worker=r.worker,
        outcome=retention_outcome(resident_tokens, reserved, block_size),
        reserved_tokens=reserved, resident_tokens=resident_tokens)


def correct_ledger(
    now: float, ledger: KvLedger, worker: str, session_blocks: Mapping[str, int],
    grace_s: float,
) -> list[RetentionCorrected]:
    """Shrink each reservation on ``worker`` to the blocks its session still holds there
    (one made less than ``grace_s`` ago is left alone: its call's last blocks may not have
    reached the index yet)."""
    out = []
    for r in ledger.reservations(worker):
        if now - r.reserved_at < grace_s:
            continue
        resident = session_blocks.get(r.session, 0)
        if ledger.correct(r.session, resident) is not None:
            out.append(RetentionCorrected(ts=now, session=r.session, worker=worker,
                                          reserved_blocks=r.blocks, resident_blocks=resident))
    return out
