"""The session table: which session a request belongs to, and what is remembered about it.

Explicit ids (header or body) name a session directly. Requests without one are matched by
their append-only history:

- after a request of a session got a successful reply, the session is indexed under the hash
  of that request's history + the reply (a *continuation key*); a later request that strictly
  extends it belongs to the session;
- after a request failed (error, timeout, client gone), the session is indexed under the hash
  of that request's history (a *retry key*); a request with exactly that history is a retry and
  belongs to the session, not a new one;
- while a request is in flight the session has no key, so a concurrent request with the same
  history (another run of the same task) becomes a new session.

A Responses API request that names ``previous_response_id`` (and no explicit id) belongs to the
session whose reply carried that id: each session keeps the hashes of its latest replies' ids
(:data:`RESPONSE_IDS_KEPT`), forgotten with it. An id another replica made is found in the
store's reply index by the caller, which passes the session's key (``linked_key``); an id known
nowhere is no link: the request is placed as it would be without it.

Sessions are forgotten after their final turn, after ``idle_ttl_s`` unseen, or when more than
``max_sessions`` are kept (least recently seen first). Everything is scoped by tenant.

Pure code: no I/O; ``now`` is a parameter.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from marsproxy.core.canon import History, Reply
from marsproxy.core.replies import reply_hash

Source = Literal["header", "body", "chain", "response", "new"]
_IndexKey = tuple[str, str, int, bytes]  # tenant, history kind, prefix length, prefix hash
_ResponseKey = tuple[str, bytes]  # tenant, hash of a reply's id
RESPONSE_IDS_KEPT = 8
"""Reply ids remembered per session, the latest: a client continues from its last reply, or
branches from one shortly before (the table's cap and TTL bound them all)."""


@dataclass
class Session:
    key: str
    tenant: str
    chained: bool  # identified by history, not by an explicit id
    last_seen: float
    in_flight: int = 0
    latest: int = 0  # sequence number of the session's newest request
    first: int = 0  # of its first: an older request's session was forgotten (its key reused)
    index_key: _IndexKey | None = None
    index_mode: Literal["continue", "retry"] = "continue"
    ephemeral: bool = False  # no id and no history: nothing to remember after the request
    turns: int = 0
    response_keys: list[_ResponseKey] = field(default_factory=list)  # oldest first


@dataclass(frozen=True)
class Turn:
    """One request of a session, from start to finish."""

    session: str
    source: Source
    history: History | None
    final: bool
    seq: int = 0

    @property
    def capture_reply(self) -> bool:
        """Only chain-matched sessions need their reply text (explicit ids need no history)."""
        return self.history is not None


@dataclass
class _Lengths:
    # How many index keys exist per (tenant, kind) and prefix length: the lengths worth probing.
    counts: dict[int, int] = field(default_factory=dict)


class SessionTable:
    def __init__(
        self,
        *,
        idle_ttl_s: float,
        max_sessions: int,
        chain_matching: bool = True,
        on_forget: Callable[[str], None] | None = None,
    ) -> None:
        self._ttl = idle_ttl_s
        self._max = max_sessions
        self._chain = chain_matching
        self._on_forget = on_forget
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently seen first
        self._index: dict[_IndexKey, list[str]] = {}
        self._responses: dict[_ResponseKey, str] = {}  # reply id → session key
        self._lengths: dict[tuple[str, str], _Lengths] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, key: str) -> Session | None:
        return self._sessions.get(key)

    def of(self, turn: Turn) -> Session | None:
        """The session ``turn`` belongs to; ``None`` once it was forgotten, even where a new
        session took its key since (that one's count is not the turn's)."""
        sess = self._sessions.get(turn.session)
        return sess if sess is not None and sess.first <= turn.seq else None

    def keys(self) -> list[str]:
        return list(self._sessions)

    # -- requests -----------------------------------------------------------------------------

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
        """A request arrives: find or create its session and mark it in flight.

        ``previous_response``: the reply id a Responses API request continues from;
        ``linked_key``: the session another replica knows by that id (the store's reply index),
        joined or added under that key where this table does not know the id."""
        self.expire(now)
        source: Source
        linked = None if previous_response is None else self.of_response(tenant, previous_response)
        if linked is None and linked_key is not None and explicit_id is None:
            linked = self._sessions.get(linked_key) or self._add(
                Session(linked_key, tenant, chained=False, last_seen=now))
        if explicit_id is not None:
            key = f"{tenant}/id/{explicit_id}"
            source = explicit_source
            sess = self._sessions.get(key)
            if sess is None:
                sess = self._add(Session(key, tenant, chained=False, last_seen=now))
            hist = None
        elif linked is not None:
            # Its history is only what is new since that reply: no chain key to take from it.
            sess, source, hist = linked, "response", None
            self._unindex(sess)
        elif self._chain and history is not None and history.length > 0:
            found = self._match(tenant, history)
            if found is None:
                key = f"{tenant}/chain/{next(self._ids)}"
                sess = self._add(Session(key, tenant, chained=True, last_seen=now))
                source = "new"
            else:
                sess, source = found, "chain"
            self._unindex(sess)
            hist = history
        else:
            key = f"{tenant}/anon/{next(self._ids)}"
            sess = self._add(Session(key, tenant, chained=False, last_seen=now, ephemeral=True))
            source, hist = "new", None
        sess.in_flight += 1
        sess.turns += 1
        sess.latest = next(self._ids)
        sess.first = sess.first or sess.latest
        sess.last_seen = now
        self._sessions.move_to_end(sess.key)
        return Turn(sess.key, source, hist, final, sess.latest)

    def finish(self, turn: Turn, *, ok: bool, reply: Reply | None, now: float,
               response_id: str | None = None) -> None:
        """A request ended; ``ok`` with its ``reply`` (chain sessions) or failed.
        ``response_id``: the id of a Responses API reply, which a next request may name."""
        sess = self.of(turn)
        if sess is None:
            return
        sess.in_flight = max(0, sess.in_flight - 1)
        sess.last_seen = now
        self._sessions.move_to_end(sess.key)
        if ok and response_id and not turn.final:
            self._remember_response(sess, response_id)
        if (ok and turn.final) or (sess.ephemeral and not sess.in_flight):
            self.forget(sess.key)
            return
        if turn.history is None or sess.latest != turn.seq:
            return  # explicit id, or a newer request of this session superseded this one
        if ok and reply is not None:
            self._index_at(sess, turn.history.kind, turn.history.key_after(reply), "continue")
        elif not ok:
            self._index_at(sess, turn.history.kind, turn.history.key(), "retry")
        # ok without a reply (nothing captured): keep no key; the next request starts anew.

    def forget(self, key: str) -> None:
        sess = self._sessions.pop(key, None)
        if sess is None:
            return
        self._unindex(sess)
        for rkey in sess.response_keys:
            if self._responses.get(rkey) == key:
                del self._responses[rkey]
        if self._on_forget is not None:
            self._on_forget(key)

    def expire(self, now: float) -> None:
        """Forget sessions idle past the TTL, then the least recently seen over the cap."""
        while self._sessions:
            key, sess = next(iter(self._sessions.items()))
            if now - sess.last_seen < self._ttl:
                break
            if sess.in_flight:
                # Not idle: a request of it is held for admission or still streaming.
                sess.last_seen = now
                self._sessions.move_to_end(key)
                continue
            self.forget(key)
        while len(self._sessions) > self._max:
            self.forget(next(iter(self._sessions)))

    # -- reply ids ------------------------------------------------------------------------------

    def of_response(self, tenant: str, response_id: str) -> Session | None:
        """The session whose reply carried ``response_id`` (``None``: not known here)."""
        key = self._responses.get((tenant, reply_hash(response_id)))
        return None if key is None else self._sessions.get(key)

    def _remember_response(self, sess: Session, response_id: str) -> None:
        rkey = (sess.tenant, reply_hash(response_id))
        self._responses[rkey] = sess.key
        sess.response_keys.append(rkey)
        sess.ephemeral = False  # a next request may name it: the session goes on
        while len(sess.response_keys) > RESPONSE_IDS_KEPT:
            old = sess.response_keys.pop(0)
            if self._responses.get(old) == sess.key and old not in sess.response_keys:
                del self._responses[old]

    # -- chain index ----------------------------------------------------------------------------

    def _add(self, sess: Session) -> Session:
        self._sessions[sess.key] = sess
        while len(self._sessions) > self._max:
            self.forget(next(iter(self._sessions)))
        return sess

    def _match(self, tenant: str, history: History) -> Session | None:
        lengths = self._lengths.get((tenant, history.kind))
        if lengths is None:
            return None
        n = history.length
        # Longest known prefix first: the most specific history wins.
        for k in sorted((k for k in lengths.counts if k <= n), reverse=True):
            keys = self._index.get((tenant, history.kind, k, history.prefix_hash(k)))
            for skey in keys or ():
                sess = self._sessions[skey]
                if sess.in_flight:
                    continue
                if sess.index_mode == "continue" and k < n:
                    return sess
                if sess.index_mode == "retry" and k == n:
                    return sess
        return None

    def _index_at(
        self,
        sess: Session,
        kind: str,
        key: tuple[int, bytes],
        mode: Literal["continue", "retry"],
    ) -> None:
        self._unindex(sess)
        n, digest = key
        if n == 0:
            return
        ikey: _IndexKey = (sess.tenant, kind, n, digest)
        self._index.setdefault(ikey, []).append(sess.key)
        lengths = self._lengths.setdefault((sess.tenant, kind), _Lengths())
        lengths.counts[n] = lengths.counts.get(n, 0) + 1
        sess.index_key, sess.index_mode = ikey, mode

    def _unindex(self, sess: Session) -> None:
        ikey = sess.index_key
        if ikey is None:
            return
        sess.index_key = None
        keys = self._index.get(ikey)
        if keys is not None:
            keys.remove(sess.key)
            if not keys:
                del self._index[ikey]
        lkey = (ikey[0], ikey[1])
        lengths = self._lengths[lkey]
        left = lengths.counts[ikey[2]] - 1
        if left:
            lengths.counts[ikey[2]] = left
        else:
            del lengths.counts[ikey[2]]
            if not lengths.counts:
                del self._lengths[lkey]
