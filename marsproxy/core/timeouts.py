"""How long an admitted session that sends nothing keeps what it holds: its KV room and slot
(the hold), and its admission (the idle timeout). Both scale with its usual tool time.

Pure code: no I/O, no clock.
"""

from __future__ import annotations


def kv_hold_s(usual_tool_s: float | None, factor: float, min_s: float, idle_s: float,
              reprefill_s: float | None = None, reprefill_factor: float = 0.0) -> float:
    """How long a dormant session's KV budget (and slot) is held for it: factor × its usual tool
    time, at least ``min_s``, at most its idle timeout; without tool history, ``min_s``. Away
    longer, it is likely done (a plain client's task): admitted still, it holds neither.

    With tool history and ``reprefill_factor``, the floor is at most ``reprefill_factor`` ×
    ``reprefill_s`` (what rebuilding its context would cost the engine): holding room for a
    prefix cheaper to rebuild than the hold is long costs the sessions waiting for that room
    more than losing the prefix costs this one. Without history the floor stays: the first
    gap's hold also tells whether the tenant's sessions come back."""
    if usual_tool_s is None:
        return min(idle_s, min_s)
    if reprefill_factor > 0 and reprefill_s is not None:
        min_s = min(min_s, reprefill_factor * reprefill_s)
    return min(idle_s, max(min_s, factor * usual_tool_s))


def idle_timeout_s(usual_tool_s: float | None, factor: float, min_s: float, max_s: float) -> float:
    """clamp(factor × usual tool time, min, max); without any tool history, the floor.

    No history means no session has come back from a tool phase yet (e.g. clients that send
    one request per session without the final flag): holding their slots for the cap would
    starve everyone else, while a session that does return after the floor just queues again.
    """
    if usual_tool_s is None:
        return min_s
    return max(min_s, min(max_s, factor * usual_tool_s))
