"""Whether an agent's reply ends its task: a reply that calls no tool, from a key whose
replies call tools, and whose sessions do not come straight back after such a reply.

A tool-calling agent (OpenAI function calling, Anthropic tool use: Claude Code, Codex, the
agent SDKs) runs a loop: a reply that calls a tool is followed by the tool's result in its next
request, and the reply that calls none is its answer, the loop's end. A plain client sends no
final flag, so without this its session would hold its window slot and its KV room until the
idle timeout, a minute after the task was done. Agents that act in text (Aider, SWE-agent's
text mode) never reply with a tool call, so only a tenant (API key) whose replies have carried
tool calls has its sessions ended this way. A reply cut at ``max_tokens`` without a tool call
ends the loop too (agent loops look for tool calls, not for the finish reason); an error or a
reply whose end was not seen is neither kind and ends nothing, and so is a text reply to a
request that offered no tools (a harness's side request under the same session: the gateway
reads it so, ``gateway/http/reply_kind.py``).

Some harnesses answer a reply without a tool call themselves and go on (OpenHands' headless
"please continue", SWE-agent's requery when no tool was called): their sessions come back at
once, and ending them would queue each return as a new session. So every such answer is
watched: whether its session's next request comes within ``window_s`` (the KV hold's floor: the
time its room would have been held). A tenant whose latest answered sessions (``history`` of
them) came back at least half the time keeps its sessions through their answers; with nothing
remembered, answers end them. A client that comes back later (a person's next instruction)
starts a new session.

Pure code: no I/O, no clock (``now`` is a parameter).
"""

from __future__ import annotations

from collections import deque
from enum import StrEnum


class ReplyKind(StrEnum):
    TOOL_CALL = "tool_call"
    """The reply calls at least one tool."""
    ANSWER = "answer"
    """The reply finished (whatever stopped it) and calls no tool."""


class AnswerTally:
    """Per tenant: whether its replies have carried tool calls, and whether its sessions came
    back soon after their answers (the latest ``history`` of them)."""

    def __init__(self, history: int, window_s: float) -> None:
        if history < 1 or window_s < 0:
            raise ValueError(f"history must be ≥ 1 and window_s ≥ 0, got {history}, {window_s}")
        self._history, self.window_s = history, window_s
        self._callers: set[str] = set()
        self._seen: dict[str, deque[bool]] = {}
        self._watched: dict[str, tuple[str, float]] = {}  # session → (tenant, answered at)

    def ends_task(self, tenant: str, kind: ReplyKind | None) -> bool:
        """Hear one reply of ``tenant``'s; True when it is the answer that ends its task."""
        if kind is ReplyKind.TOOL_CALL:
            self._callers.add(tenant)
            return False
        return kind is ReplyKind.ANSWER and tenant in self._callers and not self.goes_on(tenant)

    def answered(self, session: str, tenant: str, now: float) -> None:
        """``session`` (of a tenant that calls tools) got an answer: watch for its return."""
        if tenant in self._callers:
            self._watched[session] = (tenant, now)

    def arrived(self, session: str, now: float) -> None:
        """A request of ``session`` arrives (its return, if its answer is watched)."""
        watched = self._watched.pop(session, None)
        if watched is not None:
            self._record(watched[0], now - watched[1] <= self.window_s)

    def expire(self, now: float) -> None:
        """Answered sessions not back within the window did not come back."""
        for session, (tenant, at) in list(self._watched.items()):
            if now - at > self.window_s:
                del self._watched[session]
                self._record(tenant, False)

    def goes_on(self, tenant: str) -> bool:
        """Whether ``tenant``'s sessions go on after their answers: at least half of the
        remembered ones came back within the window (none remembered: no)."""
        seen = self._seen.get(tenant)
        return seen is not None and 2 * sum(seen) >= len(seen)

    def __contains__(self, tenant: object) -> bool:
        """Whether ``tenant``'s replies have carried tool calls."""
        return tenant in self._callers

    def _record(self, tenant: str, came_back: bool) -> None:
        seen = self._seen.get(tenant)
        if seen is None:
            seen = self._seen[tenant] = deque(maxlen=self._history)
        seen.append(came_back)
