"""The session table as the gateway uses it: it also says *why* and *when* a session ended.

:class:`marsproxy.core.sessions.SessionTable` forgets sessions on several paths (final turn,
idle TTL, over the cap, one-shot requests) and only reports the key. Overriding ``forget``
catches every path with the session still in hand, so ``session_end`` gets its reason, turns
and duration. Session keys are ``<tenant>/id/<explicit id>``, ``<tenant>/chain/<n>`` or
``<tenant>/anon/<n>``; :func:`unscoped_id` is what operators and agents call the session.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from marsproxy.core.canon import History, Reply
from marsproxy.core.sessions import Session, SessionTable, Turn

EndReason = Literal["final", "idle", "evicted", "deleted"]
EndCallback = Callable[[Session, EndReason, float], None]
"""Called with (session, reason, seconds since it began) after it was forgotten."""


def unscoped_id(key: str) -> str:
    """The session's id without the tenant: the explicit id, or ``chain/<n>``/``anon/<n>``."""
    rest = key.split("/", 1)[1] if "/" in key else key
    return rest[3:] if rest.startswith("id/") else rest


def keys_for(tenant: str, session_id: str) -> tuple[str, ...]:
    """The keys a tenant's ``session_id`` may name (explicit ids first)."""
    keys = [f"{tenant}/id/{session_id}"]
    kind, _, n = session_id.partition("/")
    if kind in ("chain", "anon") and n.isdigit():
        keys.append(f"{tenant}/{session_id}")
    return tuple(keys)


class ObservedSessions(SessionTable):
    def __init__(self, *, idle_ttl_s: float, on_end: EndCallback, **kw: Any) -> None:
        super().__init__(idle_ttl_s=idle_ttl_s, **kw)
        self._idle_ttl = idle_ttl_s
        self._on_end = on_end
        self._born: dict[str, float] = {}
        self._now = 0.0  # clock of the call into the table that is forgetting
        self._reason: EndReason | None = None  # set by callers whose forgets have one reason

    def start(
        self,
        *,
        tenant: str,
        explicit_id: str | None,
        explicit_source: Literal["header", "body"] = "header",
        history: History | None,
        final: bool,
        now: float,
    ) -> Turn:
        self._now = now
        turn = super().start(
            tenant=tenant,
            explicit_id=explicit_id,
            explicit_source=explicit_source,
            history=history,
            final=final,
            now=now,
        )
        self._born.setdefault(turn.session, now)
        return turn

    def finish(self, turn: Turn, *, ok: bool, reply: Reply | None, now: float) -> None:
        # finish only forgets a session on its last turn (final flag, or a one-shot request).
        self._now, self._reason = now, "final"
        try:
            super().finish(turn, ok=ok, reply=reply, now=now)
        finally:
            self._reason = None

    def expire(self, now: float) -> None:
        self._now = now
        super().expire(now)

    def end(self, key: str, now: float) -> bool:
        """``DELETE /mars/v1/sessions/{id}``: forget it now; False if there was no such session."""
        if self.get(key) is None:
            return False
        self._now, self._reason = now, "deleted"
        try:
            self.forget(key)
        finally:
            self._reason = None
        return True

    def forget(self, key: str) -> None:
        sess = self.get(key)
        if sess is not None:
            born = self._born.pop(key, self._now)
            reason = self._reason
            if reason is None:
                # expire() forgets the idle ones first, then the least recently seen over the cap.
                reason = "idle" if self._now - sess.last_seen >= self._idle_ttl else "evicted"
            # Before the table lets go, so the callback still sees the session's worker.
            self._on_end(sess, reason, max(0.0, self._now - born))
        super().forget(key)
