"""The simulated agents: one per planned session, and the token ids of their prompts.

Prompts are append-only, as the live benchmark sends them: a shared system prompt, the prefix
its group shares (``PlannedSession.group``, if any), then the session's own tokens (a unique
first one, so prefixes diverge), every reply included.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from marsproxy.emulator.profiles import EngineProfile
from marsproxy.emulator.tokenizer import filler_token_id
from marsproxy.runs.ideal import ideal_seconds
from marsproxy.runs.results import SessionOutcome
from marsproxy.runs.trees import tree_of
from marsproxy.runs.workload import PlannedSession, Workload

_SYSTEM_BASE = 100  # token ids of the shared system prompt start here
_SESSION_BASE = 10_000_000  # each session's first own token: unique, so prefixes diverge
_FILL = 7  # the rest of a session's new tokens (the hash chain keeps them apart)
_GROUP_BASE = 20_000_000  # a group's shared prefix: its own run of ids per group
_GROUP_STRIDE = 1_000_000


@dataclass(slots=True)
class Agent:
    plan: PlannedSession
    seq: int
    outcome: SessionOutcome
    turn: int = 0
    worker: str | None = None
    context: int = 0  # tokens in KV after the previous call: its prompt and reply
    call: int | None = None  # the scheduler core's ticket of the call in the gate or running
    incarnation: int | None = None  # its session as the plane's answer to its request named it
    tokens: list[int] = field(default_factory=list)
    prompted: int = -1  # the turn whose prompt ``tokens`` holds (-1: none yet)
    sent_s: float = 0.0
    first_token_s: float | None = None
    done: bool = False


def agents_for(workload: Workload, profile: EngineProfile, time_scale: float) -> dict[str, Agent]:
    """One agent per planned session, by id; its outcome's ideal time priced on ``profile``."""
    out = {}
    for i, plan in enumerate(workload.sessions):
        llm, tool = ideal_seconds(plan, profile, time_scale)
        out[plan.id] = Agent(plan, i, SessionOutcome(plan.id, plan.arrival_s, llm + tool,
                                                     len(plan.turns), tree=tree_of(plan),
                                                     group=plan.mix))
    return out


def mark_unfinished(agents: dict[str, Agent], stopped_s: float) -> None:
    """Agents still running when the simulation stops fail there."""
    for agent in agents.values():
        if not agent.done and not agent.outcome.error:
            agent.outcome.error = "unfinished at the simulation horizon"
            agent.outcome.stopped_s = stopped_s


class Prompts:
    def __init__(self, system_prompt_tokens: int) -> None:
        self._system = list(range(_SYSTEM_BASE, _SYSTEM_BASE + system_prompt_tokens))
        self._reply: list[int] = []

    def next(self, agent: Agent) -> list[int]:
        """The agent's prompt for its current turn: its history grown to the planned size (the
        same list when asked again in the same turn)."""
        if agent.prompted == agent.turn and agent.tokens:
            return agent.tokens
        agent.prompted = agent.turn
        plan = agent.plan
        turn = plan.turns[agent.turn]
        if not agent.tokens:
            agent.tokens = [*self._system]
            if plan.group is not None:
                start = _GROUP_BASE + plan.group * _GROUP_STRIDE
                agent.tokens.extend(range(start, start + plan.shared_tokens))
            agent.tokens.append(_SESSION_BASE + agent.seq)
        grow = max(1, turn.input_tokens - len(agent.tokens))
        agent.tokens.extend(itertools.repeat(_FILL, grow))
        return agent.tokens

    def reply(self, n: int) -> list[int]:
        """The token ids of an ``n``-token reply."""
        while len(self._reply) < n:
            self._reply.append(filler_token_id(len(self._reply)))
        return self._reply[:n]
