"""What one admission pass works with: the workers' views, their shrinking rooms, and what a
pass hands out.

Pure code: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from marsproxy.aimd.order_index import QueueEntry
from marsproxy.core.kv import blocks_for_tokens, fits

__all__ = ["Admission", "Offer", "Room", "Tally", "WorkerView", "max_tokens", "place", "room_of",
           "take"]


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the load balancer needs to know about one worker."""

    name: str
    admitted: int
    """Sessions holding a slot there (``SessionLifecycle.load_on``): what the limit bounds and
    placement balances."""
    limit: int
    """The controller's effective limit."""
    healthy: bool = True
    stale: bool = False
    budget_blocks: int | None = None
    """core.kv.kv_budget; ``None``: the worker reports no block counts."""
    free_blocks: int | None = None
    retained_blocks: int = 0
    peak_room_blocks: int | None = None
    """First-prompt blocks a new session's forecast peak leaves room for (``None``: off); the
    budget includes it already, the long-session pack is bounded by it too."""
    block_size: int = 16
    total_blocks: int | None = None
    """The worker's KV blocks (``None``: not reported): the classes' reserve is a share of it."""
    long_admitted: int = 0
    in_call: int = 0
    """Sessions of this replica in an LLM call there now."""
    kv_overloaded: bool = False
    cpu_overloaded: bool = False
    idle_s: float | None = None
    """How long the worker has run nothing while its sessions sit in tool phases (``None``:
    something runs there, or nothing is admitted)."""
    free_budget_blocks: int | None = None
    """The budget without the forecast-peak fit: free blocks now (idle admissions)."""
    idle_limit: int = 0
    """Sessions an idle admission may bring the worker to: the limit without the tool-CPU
    bound while KV is not overloaded (an idle engine is no tool CPU's bottleneck)."""
    placed: int = 0
    """Sessions placed there so far (``SessionLifecycle.placed_on``): the tie-break."""
    protected_budget_blocks: int | None = None
    """The budget of a session that would yield to nobody, while sessions that yield hold KV
    there (``yields.py``; ``None``: none do: ``budget_blocks`` for all)."""

    @property
    def placeable(self) -> bool:
        # A stale worker cannot be seen, so nothing new goes there (fail closed).
        return self.healthy and not self.stale


@dataclass(frozen=True, slots=True)
class Admission:
    entry: QueueEntry
    worker: str
    forced: bool = False
    """Admitted by the no-deadlock rule, without fitting."""
    idle: bool = False
    """Admitted onto an idle worker past the forecast-peak fit (``admission.tuning.idle_admit``)."""


@dataclass(slots=True)
class Room:
    # One worker's capacity during one pass, shrinking as sessions are placed.
    view: WorkerView
    index: int
    slots: int
    budget: int | None
    pack: int | None
    long_admitted: int
    placed: int = 0
    protected: int | None = None
    """``WorkerView.protected_budget_blocks``, shrinking as ``budget``."""

    def budget_of(self, protected: bool, grows: bool = True) -> int | None:
        """The budget a session that would yield to nobody (or one that would) is fitted
        against; ``None`` for one forecast not to grow (a one-shot task): it holds no KV past
        its call, so what the cache cannot take waits in the engine's own queue, as with no
        proxy, rather than in the proxy's for room a call's end gives back."""
        if not grows:
            return None
        budget = self.budget
        if protected and self.protected is not None:
            return max(self.protected, budget) if budget is not None else self.protected
        return budget

    def rank(self) -> tuple[int, int, int]:
        # Fewest sessions holding KV first (an engine with fewer runs each call faster), ties to
        # the fewest placed there so far, then in worker order: with equal loads, as round robin
        # spreads sessions without a proxy (loads fall back to equal as sessions go dormant).
        return (-(self.view.admitted + self.placed), -(self.view.placed + self.placed),
                -self.index)


class Offer(Enum):
    PLACED = 1
    PASSED = 2  # not placed; go on with the next session
    HELD = 3  # not placed and holding capacity against the classes after its own
    SKIP = 4  # not placed, nor anything after it in its tenant's lane (shortest first)
    STOP = 5  # the pass is over


@dataclass(slots=True)
class Tally:
    slots: int  # free slots left in this pass, all workers together
    shorts: int  # short sessions still waiting
    bound: float | None = None  # no prompt larger fits anywhere (None: no limit known)
    flat_bound: float | None = None  # the same for sessions forecast not to grow
    waiting: list[QueueEntry] = field(default_factory=list)  # passed over for their prefix

    def beyond(self, e: QueueEntry) -> bool:
        """Whether ``e`` is too large for every room."""
        bound = self.bound if e.grows else self.flat_bound
        return bound is not None and e.est_tokens > bound

    def rebound(self, rooms: list[Room]) -> None:
        """The bounds of the rooms as they are now."""
        self.bound = max_tokens(rooms, self.shorts > 0)
        self.flat_bound = max_tokens(rooms, self.shorts > 0, grows=False)




def max_tokens(rooms: list[Room], shorts_wait: bool, grows: bool = True) -> float | None:
    """The largest prompt any room could take now (``None``: no limit known); ``grows``: of a
    session forecast to grow."""
    best = 0.0
    for r in rooms:
        if r.slots <= 0:
            continue
        budget = r.budget_of(True, grows)
        cap = budget if shorts_wait or r.pack is None else max(r.pack, budget or 0)
        if cap is None:
            return None
        best = max(best, cap * r.view.block_size)
    return best


def room_of(w: WorkerView, index: int, long_pack_frac: float) -> Room:
    """A placeable worker's room at the start of a pass."""
    pack = None
    if w.free_blocks is not None:
        pack = int(long_pack_frac * w.free_blocks) - w.retained_blocks
        if w.peak_room_blocks is not None:
            pack = min(pack, w.peak_room_blocks)
    return Room(w, index, max(0, w.limit - w.admitted), w.budget_blocks, pack,
                w.long_admitted, protected=w.protected_budget_blocks)


def place(e: QueueEntry, rooms: list[Room], shorts_wait: bool, *, protected: bool,
          max_long: int) -> tuple[Room | None, bool]:
    """The room for ``e`` (fewest sessions first) and whether only the long cap
    (``max_long`` long sessions per worker while short ones wait) stood in the way;
    ``protected``: ``e`` would yield to nobody once admitted."""
    best: Room | None = None
    capped = False
    for r in rooms:
        if r.slots <= 0 or (e.bound is not None and r.view.name != e.bound):
            continue
        blocks = blocks_for_tokens(e.est_tokens, r.view.block_size)
        budget = r.budget_of(protected, e.grows)
        if e.long and shorts_wait:
            if r.long_admitted >= max_long:
                capped = capped or fits(blocks, budget)
                continue
            ok = fits(blocks, budget)
        elif e.long:
            # Only long ones wait: pack them into a fraction of free KV, no count cap.
            ok = fits(blocks, r.pack if r.pack is not None else budget)
        else:
            ok = fits(blocks, budget)
        if ok and (best is None or r.rank() > best.rank()):
            best = r
    return best, capped and best is None


def take(room: Room, e: QueueEntry) -> None:
    blocks = blocks_for_tokens(e.est_tokens, room.view.block_size)
    room.slots -= 1
    room.placed += 1
    if room.budget is not None:
        room.budget -= blocks
    if room.protected is not None:
        room.protected -= blocks
    if room.pack is not None:
        room.pack -= blocks
    if e.long:
        room.long_admitted += 1

