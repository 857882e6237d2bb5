"""How long an admitted session that sends nothing keeps what it holds: its KV room and slot
(the hold), and its admission (the idle timeout). Both scale with its usual tool time.

Pure code: no I/O, no clock.
"""

from __future__ import annotations


def kv_hold_s(usual_tool_s: float | None, factor: float, min_s: float, idle_s: float) -> float:
    """How long a dormant session's KV budget (and slot) is held for it: factor × its usual tool
    time, at least ``min_s``, at most its idle timeout; without tool history, ``min_s``. Away
    longer, it is likely done (a plain client's task): admitted still, it holds neither."""
    if usual_tool_s is None:
        return min(idle_s, min_s)
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
