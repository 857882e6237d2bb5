"""Whether an agent's reply ends its task: a reply that calls no tool, from a key whose
replies call tools.

A tool-calling agent (OpenAI function calling, Anthropic tool use: Claude Code, Codex, the
agent SDKs, OpenHands) runs a loop: a reply that calls a tool is followed by the tool's result
in its next request, and the reply that calls none is its answer, the loop's end. A plain client
sends no final flag, so without this its session would hold its window slot and its KV room
until the idle timeout, a minute after the task was done. Agents that act in text (Aider,
SWE-agent) never reply with a tool call, so only a tenant (API key) whose replies have carried
tool calls has its sessions ended this way. A reply cut at ``max_tokens`` without a tool call
ends the loop too (agent loops look for tool calls, not for the finish reason); an error or a
reply whose end was not seen is neither kind and ends nothing, and so is a text reply to a
request that offered no tools (a harness's side request under the same session: the gateway
reads it so, ``gateway/http/reply_kind.py``). A client that comes back after the answer (a
person's next instruction) starts a new session under the same key.

Pure code: no I/O.
"""

from __future__ import annotations

from enum import StrEnum


class ReplyKind(StrEnum):
    TOOL_CALL = "tool_call"
    """The reply calls at least one tool."""
    ANSWER = "answer"
    """The reply finished (whatever stopped it) and calls no tool."""


class ToolCallers:
    """The tenants whose replies have carried tool calls (one entry per API key)."""

    def __init__(self) -> None:
        self._tenants: set[str] = set()

    def ends_task(self, tenant: str, kind: ReplyKind | None) -> bool:
        """Hear one reply of ``tenant``'s; True when it is the answer that ends its task."""
        if kind is ReplyKind.TOOL_CALL:
            self._tenants.add(tenant)
            return False
        return kind is ReplyKind.ANSWER and tenant in self._tenants

    def __contains__(self, tenant: object) -> bool:
        return tenant in self._tenants
