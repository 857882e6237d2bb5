"""Session caps of the gateway's table: ids that cannot be ids, and sessions per tenant."""

from __future__ import annotations

import pytest

from marsproxy.core.canon import History, Reply
from marsproxy.gateway.shells.sessions import ObservedSessions, SessionRefused


def _table(cap: int = 2, max_sessions: int = 100) -> ObservedSessions:
    return ObservedSessions(
        idle_ttl_s=10.0, on_end=lambda *_: None, max_per_tenant=cap, max_id_chars=8,
        max_sessions=max_sessions,
    )


def _start(t: ObservedSessions, tenant: str, sid: str | None, now: float = 0.0,
           final: bool = False, history: History | None = None) -> str:
    return t.start(tenant=tenant, explicit_id=sid, history=history, final=final, now=now).session


@pytest.mark.parametrize("sid", ["123456789", "a\nb", "\x00", "x\x9f"])
def test_bad_ids_are_refused(sid: str) -> None:
    with pytest.raises(SessionRefused) as exc:
        _start(_table(), "t", sid)
    assert exc.value.status == 400 and exc.value.code == "invalid_session_id"


def test_tenant_cap_counts_every_way_a_session_ends() -> None:
    t = _table(cap=2, max_sessions=3)
    a = t.start(tenant="t", explicit_id="a", history=None, final=True, now=0.0)
    _start(t, "t", "b")
    with pytest.raises(SessionRefused) as exc:  # both have a request in flight
        _start(t, "t", "c")
    assert exc.value.status == 429 and exc.value.code == "tenant_session_cap"
    assert "in flight" in exc.value.message
    _start(t, "t", "b")  # an existing session is not a new one
    _start(t, "u", "c")  # another tenant is not held
    t.finish(a, ok=True, reply=None, now=1.0)  # final turn: forgotten
    assert t.tenant_sessions("t") == 1
    assert t.end("t/id/b", 2.0)  # deleted
    assert t.tenant_sessions("t") == 0
    for sid in ("d", "e"):  # served, so nothing is in flight when they go idle
        turn = t.start(tenant="t", explicit_id=sid, history=None, final=False, now=3.0)
        t.finish(turn, ok=True, reply=None, now=3.0)
    _start(t, "v", "f", now=3.0)  # over max_sessions=3: the least recently seen is evicted
    assert t.tenant_sessions("u") == 0 and t.tenant_sessions("t") == 2
    _start(t, "w", "g", now=20.0)  # all idle past the TTL
    assert t.tenant_sessions("t") == 0 and t.tenant_sessions("w") == 1


def test_a_new_session_at_the_cap_evicts_the_tenants_least_recently_seen_idle_one() -> None:
    ended: list[tuple[str, str]] = []
    t = ObservedSessions(idle_ttl_s=1000.0, on_end=lambda s, why, *_: ended.append((s.key, why)),
                         max_per_tenant=3, max_sessions=100)
    for i, sid in enumerate(("a", "b", "c")):  # one-shot tasks, answered, never ended
        turn = t.start(tenant="t", explicit_id=sid, history=None, final=False, now=float(i))
        t.finish(turn, ok=True, reply=None, now=float(i) + 0.5)
    _start(t, "u", "x", now=3.0)  # another tenant's, older than what follows: not touched
    busy = t.start(tenant="t", explicit_id="a", history=None, final=False, now=4.0)  # a again
    _start(t, "t", "d", now=5.0)  # at the cap: b goes (a was seen later, and is in flight)
    assert ended == [("t/id/b", "evicted")] and t.tenant_sessions("t") == 3
    _start(t, "t", "e", now=6.0)  # then c; a, d and e are in flight now
    assert ended[-1] == ("t/id/c", "evicted")
    with pytest.raises(SessionRefused) as exc:
        _start(t, "t", "f", now=7.0)
    assert exc.value.status == 429 and t.tenant_sessions("u") == 1
    t.finish(busy, ok=True, reply=None, now=8.0)  # a answered: it may go for the next one
    _start(t, "t", "f", now=9.0)
    assert ended[-1] == ("t/id/a", "evicted") and t.tenant_sessions("t") == 3


def test_a_chain_continuation_at_the_cap_is_not_a_new_session() -> None:
    t = _table(cap=1)
    h1 = History.of_text("hello")
    turn = t.start(tenant="t", explicit_id=None, history=h1, final=False, now=0.0)
    t.finish(turn, ok=True, reply=Reply(text=" world"), now=0.1)
    again = _start(t, "t", None, now=0.2, history=History.of_text("hello world, more"))
    assert again == turn.session
    with pytest.raises(SessionRefused):
        _start(t, "t", None, now=0.3, history=History.of_text("something else"))


def test_control_characters_are_those_of_c0_c1_and_del() -> None:
    from marsproxy.gateway.shells.sessions import session_id_problem

    for cp in range(0x300):
        control = cp < 0x20 or 0x7F <= cp < 0xA0
        assert (session_id_problem(f"a{chr(cp)}b", 256) is not None) == control, hex(cp)


def test_a_continuation_by_response_id_at_the_tenant_cap_is_no_new_session() -> None:
    t = _table(cap=1)
    a = t.start(tenant="t", explicit_id=None, history=History.of_text("task"), final=False,
                now=0.0)
    t.finish(a, ok=True, reply=None, now=1.0, response_id="resp_1")
    # Its history is new, but it names the session's reply: it continues it, evicting nothing.
    b = t.start(tenant="t", explicit_id=None, history=History.of_text("go on"), final=False,
                now=2.0, previous_response="resp_1")
    assert b.session == a.session and t.tenant_sessions("t") == 1
    with pytest.raises(SessionRefused):  # in flight, at the cap: a new session is refused
        t.start(tenant="t", explicit_id=None, history=History.of_text("other"), final=False,
                now=3.0, previous_response="resp_unknown")
    # Named by the store's reply index (another replica's reply of it): no new session either.
    c = t.start(tenant="t", explicit_id=None, history=History.of_text("more"), final=False,
                now=4.0, previous_response="resp_2", linked_key=a.session)
    assert c.session == a.session and t.tenant_sessions("t") == 1
