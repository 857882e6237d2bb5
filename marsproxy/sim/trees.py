"""Agent trees in the simulator: a parent's children start with its tool phase, and the parent
goes on when the last of them is done (finished, refused or failed), as a harness waits on
its sub-agents (``runs/trees.py`` builds the shape)."""

from __future__ import annotations

from collections.abc import Mapping

from marsproxy.sim.agents import Agent


class TreeRunner:
    def __init__(self, agents: Mapping[str, Agent]) -> None:
        self._agents = agents
        self._waiting: dict[str, int] = {}  # parent → children not done yet

    def spawn(self, agent: Agent, now: float) -> list[Agent]:
        """The children ``agent`` starts ``now``, at the end of its current call (none: a plain
        tool phase); they arrive now."""
        plan = agent.plan
        if not plan.children or agent.turn != plan.spawn_at:
            return []
        self._waiting[plan.id] = len(plan.children)
        kids = [self._agents[c] for c in plan.children]
        for k in kids:
            k.outcome.arrival_s = now
        return kids

    def done(self, agent: Agent) -> Agent | None:
        """``agent`` is done: its parent, when it was the last child the parent waited on."""
        p = agent.plan.parent
        if p is None or p not in self._waiting:
            return None
        self._waiting[p] -= 1
        if self._waiting[p] > 0:
            return None
        del self._waiting[p]
        parent = self._agents[p]
        return None if parent.done else parent
