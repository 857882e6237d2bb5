"""The session table as the gateway uses it: it also says *why* and *when* a session ended.

:class:`marsproxy.core.sessions.SessionTable` forgets sessions on several paths (final turn,
idle TTL, over the cap, one-shot requests) and only reports the key. Overriding ``forget``
catches every path with the session still in hand, so ``session_end`` gets its reason, turns
and duration. Session keys are ``<tenant>/id/<explicit id>``, ``<tenant>/chain/<n>`` or
``<tenant>/anon/<n>``; :func:`unscoped_id` is what operators and agents call the session.
"""

from __future__ import annotations

import re
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any, Literal

from marsproxy.core.canon import History, Reply
from marsproxy.core.sessions import Session, SessionTable, Turn

EndReason = Literal["final", "idle", "evicted", "deleted"]
"""evicted: over ``sessions.max_sessions``, or its tenant at ``limits.max_sessions_per_tenant``."""
END_REASONS: tuple[EndReason, ...] = ("final", "idle", "evicted", "deleted")
EndCallback = Callable[[Session, EndReason, float, float | None], None]
"""Called with (session, reason, seconds since it began, served seconds) as it is forgotten.

Served seconds: from its first request to the end of its last good response (``None`` when no
response of it ended well), the session's latency as its agent saw it, without the idle time
before an idle or eviction end.
"""


class SessionRefused(Exception):
    """A request the table will not take: a bad session id, or its tenant holds too many."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


# C0 and C1 control characters (and DEL); one regex search instead of a loop per character.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def session_id_problem(sid: str, max_chars: int) -> str | None:
    """Why ``sid`` cannot be a session id (too long, control characters), or None."""
    if len(sid) > max_chars:
        return f"session id of {len(sid)} characters exceeds limits.max_session_id_chars"
    if _CONTROL.search(sid):
        return "session id contains control characters"
    return None


def unscoped_id(key: str) -> str:
    """The session's id without the tenant: the explicit id, or ``chain/<n>``/``anon/<n>``."""
    rest = key.split("/", 1)[1] if "/" in key else key
    return rest[3:] if rest.startswith("id/") else rest


def keys_for(tenant: str, session_id: str) -> tuple[str, ...]:
    """The keys a tenant's ``session_id`` may name (explicit ids first)."""
    keys = [f"{tenant}/id/{session_id}"]
    kind, _, n = session_id.partition("/")
    # ``chain/3@r1``: another replica's session joined here by a Responses reply id.
    if kind in ("chain", "anon") and n.partition("@")[0].isdigit():
        keys.append(f"{tenant}/{session_id}")
    return tuple(keys)


class ObservedSessions(SessionTable):
    """Also enforces ``limits.max_session_id_chars`` (:meth:`start` raises
    :class:`SessionRefused` for such an id) and ``limits.max_sessions_per_tenant`` (None: no
    cap): a tenant at its cap that starts a session forgets its own least recently seen one
    with nothing in flight, as the table does over ``max_sessions`` (a batch client's one-shot
    tasks, never ended, would otherwise be refused once the cap is full); 429 only where every
    one of its sessions has a request in flight."""

    def __init__(
        self,
        *,
        idle_ttl_s: float,
        on_end: EndCallback,
        max_per_tenant: int | None = None,
        max_id_chars: int | None = None,
        chain_matching: bool = True,
        **kw: Any,
    ) -> None:
        super().__init__(idle_ttl_s=idle_ttl_s, chain_matching=chain_matching, **kw)
        self._chain_matching = chain_matching
        self._max_per_tenant = max_per_tenant
        self._max_id_chars = max_id_chars
        self._per_tenant: Counter[str] = Counter()
        self._recent: dict[str, OrderedDict[str, None]] = {}  # per tenant, least recent first
        self._idle_ttl = idle_ttl_s
        self._on_end = on_end
        self._born: dict[str, float] = {}
        self._answered: dict[str, float] = {}  # session → end of its last good response
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
        previous_response: str | None = None,
        linked_key: str | None = None,
    ) -> Turn:
        self._now = now
        if explicit_id is not None and self._max_id_chars is not None:
            problem = session_id_problem(explicit_id, self._max_id_chars)
            if problem is not None:
                raise SessionRefused(400, "invalid_session_id", problem)
        cap = self._max_per_tenant
        if cap is not None and self._per_tenant[tenant] >= cap:
            self.expire(now)  # idle ones may make room
            if self._per_tenant[tenant] >= cap and self._would_create(
                tenant, explicit_id, history, previous_response, linked_key
            ):
                self._evict_for(tenant, cap)
        turn = super().start(
            tenant=tenant,
            explicit_id=explicit_id,
            explicit_source=explicit_source,
            history=history,
            final=final,
            now=now,
            previous_response=previous_response,
            linked_key=linked_key,
        )
        if turn.session not in self._born:
            self._born[turn.session] = now
            self._per_tenant[tenant] += 1
        recent = self._recent.setdefault(tenant, OrderedDict())
        recent[turn.session] = None
        recent.move_to_end(turn.session)
        return turn

    def _evict_for(self, tenant: str, cap: int) -> None:
        """Make room for a new session of ``tenant`` at its cap: forget its least recently
        seen session with nothing in flight, or refuse."""
        for key in self._recent.get(tenant, ()):
            sess = self.get(key)
            if sess is not None and not sess.in_flight:
                self._reason = "evicted"
                try:
                    self.forget(key)
                finally:
                    self._reason = None
                return
        raise SessionRefused(
            429,
            "tenant_session_cap",
            f"each of the limits.max_sessions_per_tenant ({cap}) sessions this API key holds"
            " has a request in flight; retry when one is answered",
        )

    def _would_create(self, tenant: str, explicit_id: str | None, history: History | None,
                      previous_response: str | None, linked_key: str | None) -> bool:
        """Whether :meth:`start` would add a session (the same decision, without making it)."""
        if explicit_id is not None:
            return self.get(f"{tenant}/id/{explicit_id}") is None
        if previous_response is not None and self.of_response(tenant, previous_response):
            return False
        if linked_key is not None:
            return self.get(linked_key) is None
        if self._chain_matching and history is not None and history.length > 0:
            return self._match(tenant, history) is None
        return True

    def born(self, key: str, default: float) -> float:
        """When the session's first request came (``default`` for one not known)."""
        return self._born.get(key, default)

    def tenant_sessions(self, tenant: str) -> int:
        return self._per_tenant[tenant]

    def finish(self, turn: Turn, *, ok: bool, reply: Reply | None, now: float,
               response_id: str | None = None) -> None:
        # finish only forgets a session on its last turn (final flag, or a one-shot request).
        self._now, self._reason = now, "final"
        if ok and self.of(turn) is not None:  # not one forgotten while this request ran
            self._answered[turn.session] = now
        try:
            super().finish(turn, ok=ok, reply=reply, now=now, response_id=response_id)
        finally:
            self._reason = None
        sess = self.of(turn)
        if sess is not None:  # seen now: the last of its tenant's to evict
            self._recent[sess.tenant].move_to_end(turn.session)

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
            born = self._born.get(key, self._now)
            answered = self._answered.get(key)
            reason = self._reason
            if reason is None:
                # expire() forgets the idle ones first, then the least recently seen over the cap.
                reason = "idle" if self._now - sess.last_seen >= self._idle_ttl else "evicted"
            # Before the table lets go, so the callback still sees the session's worker; a
            # callback that fails leaves the session as it was, for the next expiry to end.
            self._on_end(sess, reason, max(0.0, self._now - born),
                         None if answered is None else max(0.0, answered - born))
            self._born.pop(key, None)
            self._answered.pop(key, None)
            left = self._per_tenant[sess.tenant] - 1
            if left > 0:
                self._per_tenant[sess.tenant] = left
                self._recent[sess.tenant].pop(key, None)
            else:
                del self._per_tenant[sess.tenant]
                self._recent.pop(sess.tenant, None)
        super().forget(key)
