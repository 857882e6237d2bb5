"""Idle admission (``admission.tuning.idle_admit``): an engine with nothing to run takes one
waiting session whose first prompt fits its free KV, past the forecast-peak fit.

Pure code: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from marsproxy.aimd.config import AdmissionTuning
from marsproxy.aimd.order_index import QueueEntry
from marsproxy.aimd.rooms import Admission, Room
from marsproxy.core.kv import blocks_for_tokens, fits


def idle_admits(
    rooms: Sequence[Room], taken: Sequence[Admission], ordered: Callable[[], list[QueueEntry]],
    tuning: AdmissionTuning, holds: Callable[[QueueEntry], bool],
) -> list[Admission]:
    """One session for each worker idle for ``idle_admit_after_s`` that this pass gave none:
    the first waiting (in the pass's order, ``ordered()``) whose first prompt fits its free KV.
    ``holds``: a session due now, which nobody behind may pass."""
    idle = [r for r in rooms if r.view.admitted < r.view.idle_limit
            and r.view.idle_s is not None and r.view.idle_s >= tuning.idle_admit_after_s]
    if not idle:
        return []
    busy = {a.worker for a in taken}
    chosen = {a.entry.session for a in taken}
    waiting = [e for e in ordered() if e.session not in chosen]
    out: list[Admission] = []
    for r in idle:
        if r.view.name in busy:
            continue
        for e in waiting:
            if (e.long and r.long_admitted >= tuning.max_long_in_flight) or (
                    e.bound is not None and e.bound != r.view.name):
                continue
            if fits(blocks_for_tokens(e.est_tokens, r.view.block_size),
                    r.view.free_budget_blocks):
                out.append(Admission(e, r.view.name, idle=True))
                waiting.remove(e)
                break
            if holds(e):
                break  # due now: nobody behind it takes the room it waits for
    return out
