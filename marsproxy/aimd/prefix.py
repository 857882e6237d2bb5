"""Prefix placement: a new session goes where its first prompt is already cached.

The queue places a session on the placeable worker with the fewest sessions that fits it. With
``placement.policy: prefix`` and the workers' KV indexes (docs/kv-events.md), the driver also
tells how many leading tokens of the session's first prompt each worker holds in its prefix
cache; :func:`prefer_prefix` then moves the session to the worker holding the longest one, if

- that worker is placeable, has a free slot (unless the window is off) and its KV budget fits
  the session's first prompt, as the queue requires of its own choice;
- it holds at least ``min_prefix_tokens`` more of the prompt than the queue's choice;
- the load guard holds: that worker has at most ``max_load_gap`` sessions more than the least
  loaded placeable worker, so one hot prefix does not pile every session on one worker.

A worker without KV events is absent from the prefix map; with no map (no worker has events,
or the prompt's tokens are unknown) nothing changes: exactly the queue's placement.

Pure code: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from marsproxy.aimd.config import PlacementConfig
from marsproxy.aimd.queue import WorkerView
from marsproxy.core.kv import blocks_for_tokens, fits


def prefer_prefix(
    cfg: PlacementConfig, views: Sequence[WorkerView], prefix: Mapping[str, int] | None,
    chosen: str, est_tokens: int, *, counted: bool, slots: bool = True,
) -> str | None:
    """The worker ``chosen`` should give way to, or ``None`` to keep it.

    ``prefix``: resident prefix tokens of the first prompt per worker with an index;
    ``counted``: the views count the session on ``chosen`` already (the queue admitted it);
    ``slots``: a target needs a free slot (false: the window is off)."""
    if cfg.policy != "prefix" or not prefix:
        return None
    placeable = [v for v in views if v.placeable]
    if not placeable:
        return None
    mine = 1 if counted else 0
    loads = {v.name: v.admitted - (mine if v.name == chosen else 0) for v in placeable}
    least = min(loads.values())
    base = prefix.get(chosen, 0)
    best: tuple[int, int, int, str] | None = None  # (-tokens, load, order, name)
    for i, v in enumerate(placeable):
        tokens = prefix.get(v.name, 0)
        if v.name == chosen or tokens < base + cfg.min_prefix_tokens:
            continue
        if loads[v.name] > least + cfg.max_load_gap:
            continue
        if slots and v.admitted >= v.limit:
            continue
        if not fits(blocks_for_tokens(est_tokens, v.block_size), v.budget_blocks):
            continue
        rank = (-tokens, loads[v.name], i, v.name)
        if best is None or rank < best:
            best = rank
    return None if best is None else best[3]
