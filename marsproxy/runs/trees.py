"""Agent trees in a workload: parents that spawn sub-agents and wait on them.

Real harnesses (Claude Code's Task tool, Codex's spawned threads) run sub-agents inside one of
the parent's tool phases: the parent's call ends with the tool call that starts them, the
sub-agents run their own sessions, and the parent's next call comes once they have all
returned. :func:`grow_trees` builds that shape out of a flat workload's sessions (so the
children are trace sessions too): in arrival order, each session with at least two calls
becomes a root and the next 2–4 sessions (seeded) its children, spawned at the tool phase in
the middle of its calls. A child keeps no arrival of its own (it starts when spawned).

The same sessions with the same tree shape can be replayed with the proxy told of the parents
(``sessions.trees``: true) or not (the ``mars-no-trees`` preset): the tree completion time
(a root's arrival to the end of its last call, children's runs included) compares the two.

Pure code: no I/O; deterministic for a seed.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from marsproxy.runs.workload import PlannedSession


def grow_trees(sessions: Sequence[PlannedSession], children: tuple[int, int],
               rng: random.Random) -> list[PlannedSession]:
    """``sessions`` (in arrival order) grouped into trees of one root and between
    ``children[0]`` and ``children[1]`` children; a root needs two calls at least."""
    lo, hi = children
    if not 1 <= lo <= hi:
        raise ValueError("trees: children must be 1 <= min <= max")
    ordered = sorted(sessions, key=lambda s: (s.arrival_s, s.id))
    out: list[PlannedSession] = []
    i = 0
    while i < len(ordered):
        root = ordered[i]
        k = rng.randint(lo, hi)
        kids = ordered[i + 1:i + 1 + k]
        if len(root.turns) < 2 or not kids:
            out.append(root)
            i += 1
            continue
        ids = tuple(c.id for c in kids)
        out.append(dataclasses.replace(root, children=ids, spawn_at=(len(root.turns) - 2) // 2))
        out.extend(dataclasses.replace(c, parent=root.id, arrival_s=root.arrival_s)
                   for c in kids)
        i += 1 + len(kids)
    return out


def tree_of(plan: PlannedSession) -> str:
    """The tree ``plan`` belongs to (its root's id), or "" for a session of no tree."""
    return plan.id if plan.children else plan.parent or ""
