"""The gateway's session table reports why each session ended (pure)."""

from __future__ import annotations

import pytest

from marsproxy.core.sessions import Session, Turn
from marsproxy.gateway.shells.sessions import ObservedSessions, keys_for, unscoped_id


def _table(ended: list[tuple[str, str, int, float]], served: list[float | None] | None = None,
           **kw: object) -> ObservedSessions:
    def on_end(sess: Session, reason: str, duration: float, served_s: float | None) -> None:
        ended.append((sess.key, reason, sess.turns, duration))
        if served is not None:
            served.append(served_s)

    args: dict[str, object] = {"max_sessions": 100, **kw}
    return ObservedSessions(idle_ttl_s=10.0, on_end=on_end, **args)


def _start(t: ObservedSessions, sid: str, now: float, final: bool = False) -> Turn:
    return t.start(tenant="t", explicit_id=sid, history=None, final=final, now=now)


def test_reasons_final_idle_evicted_deleted() -> None:
    ended: list[tuple[str, str, int, float]] = []
    t = _table(ended, max_sessions=2)
    turn = _start(t, "a", 0.0)
    t.finish(turn, ok=True, reply=None, now=1.0)
    turn = _start(t, "a", 2.0, final=True)
    t.finish(turn, ok=True, reply=None, now=3.0)
    assert ended == [("t/id/a", "final", 2, 3.0)]

    for sid, now in (("b", 4.0), ("c", 5.0)):
        t.finish(_start(t, sid, now), ok=True, reply=None, now=now)
    d = _start(t, "d", 6.0)  # over the cap of 2: the least recently seen goes
    assert ended[-1][:2] == ("t/id/b", "evicted")
    t.finish(d, ok=True, reply=None, now=6.0)  # a session with a request in flight is not idle
    t.expire(30.0)  # c and d unseen for longer than the TTL
    assert [e[:2] for e in ended[-2:]] == [("t/id/c", "idle"), ("t/id/d", "idle")]

    _start(t, "e", 40.0)
    assert t.end("t/id/e", 41.0) and not t.end("t/id/e", 41.0)
    assert ended[-1] == ("t/id/e", "deleted", 1, 1.0)
    assert len(t) == 0


def test_ids_and_keys() -> None:
    assert unscoped_id("abc/id/my/session") == "my/session"
    assert unscoped_id("abc/chain/3") == "chain/3"
    assert keys_for("abc", "x") == ("abc/id/x",)
    assert keys_for("abc", "chain/3") == ("abc/id/chain/3", "abc/chain/3")
    # Another replica's session, joined here through a Responses reply id.
    assert unscoped_id("abc/chain/3@r1") == "chain/3@r1"
    assert keys_for("abc", "chain/3@r1") == ("abc/id/chain/3@r1", "abc/chain/3@r1")
    assert keys_for("abc", "chain/x@r1") == ("abc/id/chain/x@r1",)


def test_served_span_ends_with_the_last_good_response() -> None:
    ended: list[tuple[str, str, int, float]] = []
    served: list[float | None] = []
    t = _table(ended, served)
    # Two turns, the second final: first request (0.5) to the end of the last response (3.0).
    t.finish(_start(t, "a", 0.5), ok=True, reply=None, now=1.0)
    t.finish(_start(t, "a", 2.0, final=True), ok=True, reply=None, now=3.0)
    assert ended[-1][1] == "final" and served == [2.5]
    # Idle: the time unseen afterwards is not part of it; a failed last turn does not count.
    t.finish(_start(t, "b", 10.0), ok=True, reply=None, now=12.0)
    t.finish(_start(t, "b", 13.0), ok=False, reply=None, now=14.0)
    t.expire(40.0)
    assert ended[-1][1:] == ("idle", 2, 30.0) and served[-1] == 2.0
    # Never answered: no served span.
    t.finish(_start(t, "c", 50.0), ok=False, reply=None, now=51.0)
    assert t.end("t/id/c", 52.0) and served[-1] is None
    # Deleted while its request runs: the late finish leaves nothing behind.
    turn = _start(t, "d", 60.0)
    assert t.end("t/id/d", 61.0) and served[-1] is None
    t.finish(turn, ok=True, reply=None, now=62.0)
    assert t._answered == {} and t._born == {}


def test_an_end_that_fails_leaves_the_session_for_the_next_expiry() -> None:
    ended: list[str] = []

    def on_end(sess: Session, reason: str, duration: float, served_s: float | None) -> None:
        if not ended:
            ended.append("failed")
            raise RuntimeError("a bug in a session's end")
        ended.append(sess.key)

    t = ObservedSessions(idle_ttl_s=10.0, on_end=on_end, max_sessions=100)
    t.finish(_start(t, "a", 0.0), ok=True, reply=None, now=0.0)
    with pytest.raises(RuntimeError):
        t.expire(20.0)
    # Nothing let go: the session and its tenant's count stand, once each.
    assert t.get("t/id/a") is not None and t.tenant_sessions("t") == 1
    t.expire(21.0)  # the next pass ends it, counted off once
    assert ended == ["failed", "t/id/a"] and t.tenant_sessions("t") == 0
    assert t.born("t/id/a", -1.0) == -1.0 and t.get("t/id/a") is None
    t.finish(_start(t, "b", 22.0), ok=True, reply=None, now=22.0)
    assert t.tenant_sessions("t") == 1
