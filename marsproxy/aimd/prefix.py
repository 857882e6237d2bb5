"""Prefix placement: a new session goes where its first prompt is already cached.

The queue places a session on the placeable worker with the fewest sessions that fits it. With
``placement.policy: prefix`` and the workers' KV indexes (docs/kv-events.md), the driver also
tells how many leading tokens of the session's first prompt each worker holds in its prefix
cache; :func:`prefer_prefix` then moves the session to the worker holding the longest one, if

- that worker is placeable, has a free slot (unless the window is off) and its KV budget fits
  the session's first prompt, as the queue requires of its own choice;
- it holds at least ``min_prefix_tokens`` more of the prompt than the queue's choice;
- the load guards hold: that worker has at most ``max_load_gap`` sessions more than the least
  loaded placeable worker, so one hot prefix does not pile every session on one worker, and at
  most ``max_call_gap`` LLM calls in flight more than the queue's choice.

At saturation no worker has room but the one where a slot just freed, so the move above never
happens. There a waiting session whose longest prefix is on a full worker lets the next waiting
session take the freed room (:func:`waits_for_prefix`), as long as it is not due (its deadline
near, or bypassed ``admission.tuning.max_bypass`` times) and someone else takes the room: a
room nobody else takes is its own at the end of the pass.

A worker without KV events is absent from the prefix map; with no map (no worker has events,
or the prompt's tokens are unknown) nothing changes: exactly the queue's placement.

Pure code: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from marsproxy.aimd.config import PlacementConfig
from marsproxy.aimd.queue import QueueEntry, WorkerView
from marsproxy.aimd.rooms import Room
from marsproxy.core.kv import blocks_for_tokens, fits


def _longer(
    cfg: PlacementConfig, views: Sequence[WorkerView], prefix: Mapping[str, int] | None,
    here: str, mine: int,
) -> list[tuple[int, WorkerView, int, int]]:
    """(order, view, load, tokens) of the placeable workers other than ``here`` that hold at least
    ``min_prefix_tokens`` more of the prompt and pass the session-count guard; ``mine``: the
    session is counted on ``here`` already (1) or not (0)."""
    if cfg.policy != "prefix" or not prefix:
        return []
    placeable = [v for v in views if v.placeable]
    loads = {v.name: v.admitted - (mine if v.name == here else 0) for v in placeable}
    least = min(loads.values(), default=0)
    floor = prefix.get(here, 0) + cfg.min_prefix_tokens
    return [(i, v, loads[v.name], prefix.get(v.name, 0)) for i, v in enumerate(placeable)
            if v.name != here and prefix.get(v.name, 0) >= floor
            and loads[v.name] <= least + cfg.max_load_gap]


def prefer_prefix(
    cfg: PlacementConfig, views: Sequence[WorkerView], prefix: Mapping[str, int] | None,
    chosen: str, est_tokens: int, *, counted: bool, slots: bool = True,
) -> str | None:
    """The worker ``chosen`` should give way to, or ``None`` to keep it.

    ``prefix``: resident prefix tokens of the first prompt per worker with an index;
    ``counted``: the views count the session on ``chosen`` already (the queue admitted it);
    ``slots``: a target needs a free slot (false: the window is off)."""
    mine = 1 if counted else 0
    # Calls in flight on the queue's choice, the session's own not counted: on a worker with
    # more, the new call queues behind theirs (at light load it may be prefilling the very
    # prefix for another session while the queue's choice sits idle).
    busy = next((v.in_call - mine for v in views if v.placeable and v.name == chosen), 0)
    best: tuple[int, int, int, str] | None = None  # (-tokens, load, order, name)
    for i, v, load, tokens in _longer(cfg, views, prefix, chosen, mine):
        if v.in_call > busy + cfg.max_call_gap:
            continue
        if slots and v.admitted >= v.limit:
            continue
        if not fits(blocks_for_tokens(est_tokens, v.block_size), v.budget_blocks):
            continue
        rank = (-tokens, load, i, v.name)
        if best is None or rank < best:
            best = rank
    return None if best is None else best[3]


def waits_for_prefix(
    cfg: PlacementConfig, views: Sequence[WorkerView], prefix: Mapping[str, int] | None,
    here: str, est_tokens: int,
) -> bool:
    """True when a worker other than ``here`` holds a longer prefix of the session's first
    prompt (by ``min_prefix_tokens``, within the load guard) but has no room for it now: the
    session may let a later one take ``here``'s room and wait for that worker."""
    longer = _longer(cfg, views, prefix, here, 0)
    if not longer:
        return False
    _, best, _, _ = max(longer, key=lambda c: c[3])
    return (best.admitted >= best.limit
            or not fits(blocks_for_tokens(est_tokens, best.block_size), best.budget_blocks))


class PrefixBook:
    """Each waiting session's resident prefix per indexed worker, until it is admitted."""

    def __init__(self, cfg: PlacementConfig) -> None:
        self.cfg = cfg
        self._maps: dict[str, Mapping[str, int]] = {}

    def note(self, session: str, prefix: Mapping[str, int] | None) -> None:
        if prefix:
            self._maps[session] = prefix

    def forget(self, session: str) -> None:
        self._maps.pop(session, None)

    def admitted(
        self, session: str, views: Callable[[], Sequence[WorkerView]], chosen: str,
        est_tokens: int,
    ) -> str | None:
        """The worker a session the queue just put on ``chosen`` moves to, if any
        (:func:`prefer_prefix`); its map is dropped either way."""
        prefix = self._maps.pop(session, None)
        if prefix is None:
            return None
        return prefer_prefix(self.cfg, views(), prefix, chosen, est_tokens, counted=True)

    def waits(self, e: QueueEntry, here: str, rooms: Sequence[Room]) -> bool:
        """:func:`waits_for_prefix` for a waiting session offered a room on ``here``."""
        prefix = self._maps.get(e.session)
        if prefix is None:  # most sessions: no lookup, no views
            return False
        return waits_for_prefix(self.cfg, [r.view for r in rooms], prefix, here, e.est_tokens)
