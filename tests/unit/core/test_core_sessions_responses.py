"""The session table's reply ids: a Responses API request naming ``previous_response_id``
continues the session whose reply carried it (core/sessions.py)."""

from typing import Any

from marsproxy.core.canon import History, responses_units
from marsproxy.core.identity import previous_response_id
from marsproxy.core.sessions import RESPONSE_IDS_KEPT, SessionTable, Turn


def said(text: str) -> History:
    units = responses_units(None, text)
    assert units
    return History.of_units(units)


def table(**kw: Any) -> SessionTable:
    return SessionTable(idle_ttl_s=100.0, max_sessions=kw.pop("cap", 1000), **kw)


def start(t: SessionTable, text: str | None, prev: str | None = None, now: float = 0.0,
          tenant: str = "t", sid: str | None = None, final: bool = False) -> Turn:
    return t.start(tenant=tenant, explicit_id=sid, history=None if text is None else said(text),
                   final=final, now=now, previous_response=prev)


def test_a_chain_by_reply_ids_is_one_session() -> None:
    t = table()
    a = start(t, "Fix the bug in foo.py")
    t.finish(a, ok=True, reply=None, now=1, response_id="resp_1")
    b = start(t, "2 tests failed", prev="resp_1", now=2)
    assert (b.session, b.source, b.history) == (a.session, "response", None)
    t.finish(b, ok=True, reply=None, now=3, response_id="resp_2")
    c = start(t, "all pass", prev="resp_2", now=4)
    assert (c.session, c.source) == (a.session, "response")
    sess = t.get(a.session)
    assert len(t) == 1 and sess is not None and sess.turns == 3


def test_an_unknown_id_or_another_tenants_is_a_new_session_and_an_explicit_id_wins() -> None:
    t = table()
    a = start(t, "task")
    t.finish(a, ok=True, reply=None, now=1, response_id="resp_1")
    unknown = start(t, "go on", prev="resp_elsewhere", now=2)
    other = start(t, "go on", prev="resp_1", tenant="u", now=2)
    named = start(t, "go on", prev="resp_1", sid="run-7", now=2)
    assert unknown.source == other.source == "new"
    assert len({a.session, unknown.session, other.session, named.session}) == 4
    assert named.session == "t/id/run-7"


def test_a_failed_or_final_call_leaves_no_id() -> None:
    t = table()
    a = start(t, "task")
    t.finish(a, ok=False, reply=None, now=1, response_id="resp_1")
    assert t.of_response("t", "resp_1") is None
    b = start(t, "task", now=2)  # the retry: same history, same session
    assert b.session == a.session
    t.finish(b, ok=True, reply=None, now=3, response_id="resp_2")
    last = start(t, "done?", prev="resp_2", final=True, now=4)
    t.finish(last, ok=True, reply=None, now=5, response_id="resp_3")
    assert len(t) == 0 and t.of_response("t", "resp_2") is None


def test_ids_are_bounded_per_session_and_forgotten_with_it() -> None:
    forgotten: list[str] = []
    t = table(on_forget=forgotten.append)
    turn = start(t, "task")
    for i in range(RESPONSE_IDS_KEPT):  # with resp_last: one over
        t.finish(turn, ok=True, reply=None, now=i, response_id=f"resp_{i}")
        turn = start(t, "next", prev=f"resp_{i}", now=i)
        assert turn.source == "response"
    t.finish(turn, ok=True, reply=None, now=50, response_id="resp_last")
    assert t.of_response("t", "resp_0") is None  # the oldest made room
    assert t.of_response("t", "resp_1") is not None
    t.expire(200.0)  # idle past the TTL
    assert forgotten == [turn.session]
    assert t.of_response("t", "resp_last") is None and t.of_response("t", "resp_1") is None
    assert start(t, "next", prev="resp_last", now=201).source == "new"


def test_without_chain_matching_a_reply_id_keeps_its_session_for_the_next_call() -> None:
    forgotten: list[str] = []
    t = table(chain_matching=False, on_forget=forgotten.append)
    a = start(t, "task")
    t.finish(a, ok=True, reply=None, now=1, response_id="resp_1")
    assert forgotten == []  # not a one-shot session any more: a next call may name its reply
    b = start(t, "go on", prev="resp_1", now=2)
    assert (b.session, b.source) == (a.session, "response")
    one_shot = start(t, "task")
    t.finish(one_shot, ok=True, reply=None, now=3)  # no id (store false): gone at once
    assert forgotten == [one_shot.session]


def test_previous_response_id_is_read_from_responses_bodies_only() -> None:
    assert previous_response_id("responses", {"previous_response_id": "resp_1"}) == "resp_1"
    assert previous_response_id("chat", {"previous_response_id": "resp_1"}) is None
    for odd in ("", None, 7, ["resp_1"], {"id": "resp_1"}):
        assert previous_response_id("responses", {"previous_response_id": odd}) is None
    assert previous_response_id("responses", {}) is None
    assert previous_response_id("responses", None) is None


def test_an_id_another_replica_made_joins_the_session_the_store_names() -> None:
    t = table()
    # Unknown here; the store's reply index names another replica's session: added under its key.
    a = t.start(tenant="t", explicit_id=None, history=said("tool output"), final=False, now=0,
                previous_response="resp_9", linked_key="t/chain/3@r1")
    assert (a.session, a.source, a.history) == ("t/chain/3@r1", "response", None)
    t.finish(a, ok=True, reply=None, now=1, response_id="resp_10")
    # Its next reply is known here: the same session, without the store.
    b = start(t, "more output", prev="resp_10", now=2)
    # Back on this replica after another hop: the store names the session it holds.
    c = t.start(tenant="t", explicit_id=None, history=None, final=False, now=3,
                previous_response="resp_11", linked_key="t/chain/3@r1")
    assert b.session == c.session == a.session
    sess = t.get(a.session)
    assert len(t) == 1 and sess is not None and sess.turns == 3
    # An id known here wins over the store's answer; an explicit id over both.
    d = t.start(tenant="t", explicit_id=None, history=None, final=False, now=4,
                previous_response="resp_10", linked_key="t/chain/7@r2")
    e = t.start(tenant="t", explicit_id="run-1", history=None, final=False, now=5,
                previous_response="resp_10", linked_key="t/chain/3@r1")
    assert (d.session, e.session) == (a.session, "t/id/run-1")
